"""What every handler needs: the engine, the served name, metrics, admission, and the checks
that depend on the model (context length, vocabulary)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..engine.async_engine import AsyncEngine
from ..engine.sampling_params import SamplingParams
from .admission import Admission
from .errors import APIError, bad_request
from .metrics import ServerMetrics
from .protocol import MAX_LOGPROBS

OFFLOAD_CHARS = 16_384


@dataclass
class ServerContext:
    engine: AsyncEngine
    served_model_name: str
    metrics: ServerMetrics
    admission: Admission

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.config.vocab_size

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.served_model_name}'", "model", "model_not_found")

    def check_alive(self) -> None:
        if not self.engine.alive:
            raise APIError(503, "the engine is not running")

    async def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        if isinstance(prompt, str):
            # a long prompt is tokenized off the event loop, so other streams keep flowing
            ids = (self.tokenizer.encode(prompt) if len(prompt) < OFFLOAD_CHARS
                   else await asyncio.to_thread(self.tokenizer.encode, prompt))
        else:
            ids = list(prompt)
        if not ids:
            raise bad_request("the prompt is empty after tokenization", param)
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                                f"{self.max_model_len} tokens (prompt plus at least one generated token)",
                           param, "context_length_exceeded")
        return ids

    def sampling_params(self, req, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                        seed: int | None) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise bad_request(f"'{name}' is not supported (only 0)", name)
        if max_tokens is None:
            max_tokens = self.max_model_len - prompt_len
        if logprobs is not None:
            logprobs = min(logprobs, MAX_LOGPROBS, self.vocab_size)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=seed, stop=req.stop, stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos, logprobs=logprobs,
            )
        except ValueError as exc:  # SamplingParams names the field: "SamplingParams.<field> ..."
            field = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise bad_request(str(exc), field) from exc
