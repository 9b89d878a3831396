"""What every handler needs: the engine, the served name, metrics, admission, and the checks
that depend on the model (context length, vocabulary)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..engine.sampling_params import SamplingParams, StructuredOutput
from ..engine.structured_output import SchemaError, grammar_text
from ..engine.serving_engine import ServingEngine
from .admission import Admission
from .body_limits import BodyLimits, Refusal, check_text
from .errors import APIError, bad_request, clip
from .metrics import ServerMetrics
from .protocol import MAX_LOGPROBS, ResponseFormat

OFFLOAD_CHARS = 16_384
OFFLOAD_IDS = 65_536   # prompts holding at least this many token ids are checked on a worker thread


@dataclass
class ServerContext:
    engine: ServingEngine
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

    async def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        return (await self.prompts_ids([prompt], param))[0]

    async def prompts_ids(self, prompts: list, param: str) -> list[list[int]]:
        """Token ids of each prompt (text or ids), checked against the vocabulary and the context;
        a text too long to fit is refused before it is tokenised."""
        texts = [p for p in prompts if isinstance(p, str)]
        if texts and self.tokenizer is None:
            raise bad_request("this server has no tokenizer (--skip-tokenizer-init): send the prompt as "
                              "token ids", param)
        if self.body_limits is not None:
            for text in texts:
                try:
                    check_text(len(text), param, "the prompt", self.body_limits)
                except Refusal as r:
                    raise APIError(r.status, r.message, r.param, r.code) from None
        encoded = iter(await self.encode(texts) if texts else [])
        # the body's own lists, not copies: 1,000 new lists of 15,000 ids are each young-generation
        # collection's work (measured: a 0.12 s collection on the event loop)
        ids = [next(encoded) if isinstance(p, str) else p for p in prompts]
        if sum(map(len, ids)) < OFFLOAD_IDS:
            return self._checked_all(ids, param)
        return await asyncio.to_thread(self._checked_all, ids, param)

    def _checked_all(self, prompts_ids: list[list[int]], param: str) -> list[list[int]]:
        # one prompt at a time: on a worker thread, the event loop gets the GIL in between
        return [self._checked_ids(ids, param) for ids in prompts_ids]

    def _checked_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise bad_request("the prompt is empty after tokenization", param)
        vocab = self.vocab_size
        if max(ids) >= vocab:  # max() runs in C; the first id too large is looked for only then
            bad = next(t for t in ids if t >= vocab)
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                                f"{self.max_model_len} tokens (prompt plus at least one generated token)",
                           param, "context_length_exceeded")
        return ids

    def sampling_params(self, req, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                        seed: int | None, default_max_tokens: int | None = None) -> SamplingParams:
        """``max_tokens`` None: the server's ``max_tokens_default``, else ``default_max_tokens``, capped
        by the rest of the context (the rest of the context when neither is set)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name):
                raise bad_request(f"'{name}' is not supported (only 0)", name)
        if req.logit_bias:  # refused rather than ignored: ignoring it would change what the caller gets
            raise bad_request("'logit_bias' is not supported (only empty or null)", "logit_bias")
        fits = self.max_model_len - prompt_len
        if self.max_tokens_default is not None:
            default_max_tokens = self.max_tokens_default
        if max_tokens is None:  # what fits, or less when the endpoint has a default (completions: 16)
            max_tokens = fits if default_max_tokens is None else min(default_max_tokens, fits)
        elif max_tokens > fits:  # OpenAI's and vLLM's answer, not a silent clamp
            chat = hasattr(req, "messages")
            where = "messages" if chat else "prompt"
            name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {where}, "
                                f"{max_tokens} in the completion). Please reduce the length of the {where} or "
                                f"'{name}'.", name, "context_length_exceeded")
        if logprobs is not None:
            logprobs = min(logprobs, MAX_LOGPROBS, self.vocab_size)
        if req.stop and self.tokenizer is None:
            raise bad_request("stop strings need a tokenizer and this server has none (--skip-tokenizer-init): "
                              "use stop_token_ids", "stop")
        structured = self.structured_output(req.response_format)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=seed, stop=req.stop, stop_token_ids=list(req.stop_token_ids or []),
                ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens, structured=structured,
            )
        except ValueError as exc:  # SamplingParams names the field: "SamplingParams.<field> ..."
            field = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
            raise bad_request(str(exc), field) from exc

    def structured_output(self, fmt: ResponseFormat | None) -> StructuredOutput | None:
        """``response_format`` as the engine's constraint; the schema is checked here (well under a
        millisecond) so that a bad one is a 400 naming the field."""
        if fmt is None or fmt.type == "text":
            return None
        if self.tokenizer is None:
            raise bad_request("response_format needs a tokenizer and this server has none (--skip-tokenizer-init)",
                              "response_format")
        structured = (StructuredOutput(json_object=True) if fmt.type == "json_object"
                      else StructuredOutput(json_schema=fmt.json_schema.schema_))
        try:
            grammar_text(structured)
        except SchemaError as exc:
            raise bad_request(f"'response_format.json_schema.schema' {exc.reason}", "response_format") from None
        return structured
