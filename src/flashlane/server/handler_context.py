"""What every handler needs: the engine client, the served name, metrics, admission, the body
limits, and tokenising that keeps large texts off the event loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..engine.client import EngineClient
from .admission import Admission
from .body_limits import BodyLimits
from .errors import APIError, clip
from .metrics import ServerMetrics

OFFLOAD_CHARS = 16_384   # texts holding at least this many characters are tokenised on a worker thread


@dataclass
class ServerContext:
    engine: EngineClient
    served_model_name: str
    metrics: ServerMetrics
    admission: Admission
    body_limits: BodyLimits | None = None   # what can fit at all, checked before tokenising
    child_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(2))  # body checks at once
    max_tokens_default: int | None = None   # `serve --max-tokens-default`: instead of each endpoint's default

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"the model '{clip(name)}' does not exist; this server serves "
                                f"'{self.served_model_name}'", "model", "model_not_found")

    def check_alive(self) -> None:
        if not self.engine.alive:
            raise APIError(503, "the engine is not running")

    def check_seqs(self, count: int, param: str) -> None:
        """A bound on engine requests (prompts x n) per HTTP request, checked before tokenising."""
        limit = self.body_limits.max_seqs if self.body_limits else None
        if limit is not None and count > limit:
            raise APIError(400, f"this request asks for {count} sequences (prompts x n); the server accepts at "
                                f"most {limit} per request", param)

    async def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text. Large inputs are tokenised on a worker thread through the
        ``tokenizers`` batch call, which releases the GIL (its single-text ``encode`` holds it
        throughout), so /health and other streams keep flowing meanwhile."""
        if sum(len(t) for t in texts) < OFFLOAD_CHARS:
            return [self.tokenizer.encode(t) for t in texts]
        batch = getattr(getattr(self.tokenizer, "backend", None), "encode_batch", None)
        if batch is not None:  # what Tokenizer.encode does, for many texts at once
            return await asyncio.to_thread(lambda: [e.ids for e in batch(texts, add_special_tokens=True)])
        return await asyncio.to_thread(lambda: [self.tokenizer.encode(t) for t in texts])
