"""An OpenAI-compatible server in simulated time, as an in-memory HTTP transport for the bench.

The bench's own client (``httpx.AsyncClient``) talks to this transport exactly as it talks to
``flashlane serve``: ``/health``, ``/v1/models``, and streamed ``/v1/chat/completions`` and
``/v1/completions`` with ``usage`` (prompt, completion and cached tokens) on the last chunk. Behind
it a ``SimEngine`` (the engine's real scheduler and cache manager, the step-cost model for time)
steps in the virtual time of the event loop it runs on. A request reaches the engine after the
front end's admission time; each token reaches the client ``front_end.token_s`` after the step
that made it ended. Admission is serial, as in the one API process of ``flashlane serve`` (HTTP,
chat template and tokenisation on one event loop): requests sent at once reach the engine one
admission time apart, so a burst's first step holds the first arrivals only. Nothing is
computed: generated tokens are a filler word, so only ``recorded`` replays (``ignore_eos``, fixed
lengths) are meaningful.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator

import httpx

from .front_end import FrontEnd
from .prompts import PromptTokenizer
from .sim_engine import SimEngine, SimStep

FILLER_TEXT = " w"
HOLD_CAP_S = 0.05       # the engine re-checks a held admission window at least this often (as LLMEngine does)
MIN_WAIT_S = 1e-6       # a window due "now" can still hold by a rounding error: time must move on


class SimServer(httpx.AsyncBaseTransport):
    def __init__(self, engine: SimEngine, prompts: PromptTokenizer, front_end: FrontEnd, model: str,
                 info: dict | None = None):
        self.engine, self.prompts, self.front_end, self.model = engine, prompts, front_end, model
        self.info = dict(info or {})
        self.steps: list[dict] = []
        self._streams: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._admitted_until = 0.0     # when the API process is done with the requests already sent

    # ---- the engine loop -------------------------------------------------------------------
    def start(self) -> None:
        """Start stepping (on the running loop)."""
        self._arrived = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def aclose(self) -> None:     # the client closing its transport: the server stops
        await self.stop()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            if not self._task.cancelled() and self._task.exception() is not None:
                raise self._task.exception()
            self._task = None

    async def _loop(self) -> None:
        loop, engine = asyncio.get_running_loop(), self.engine
        while True:
            if not engine.has_work:
                await self._arrived.wait()
                self._arrived.clear()
                continue
            engine.now = loop.time()
            step = engine.step()
            if step is None:      # a held admission window
                wake = engine.wake_at if engine.wake_at is not None else engine.now + HOLD_CAP_S
                await asyncio.sleep(max(MIN_WAIT_S, min(wake - engine.now, HOLD_CAP_S)))
                continue
            await asyncio.sleep(step.duration)
            self.steps.append(_record(step))
            self._deliver(loop, step)
            if self.front_end.step_gap_s and engine.has_work:
                await asyncio.sleep(self.front_end.step_gap_s)

    def _deliver(self, loop, step: SimStep) -> None:
        finished = set(step.finished)
        for rid, n in zip(step.sampled, step.sampled_tokens):
            queue = self._streams.get(rid)
            if queue is not None:     # one chunk per step, with every token the step gave (accepted drafts)
                loop.call_later(self.front_end.token_s, queue.put_nowait, (n, rid in finished))

    # ---- HTTP ------------------------------------------------------------------------------
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path.rstrip("/"), request.method
        if method in ("GET", "HEAD") and path == "/health":
            return _json(200, {"status": "ok"})
        if method == "GET" and path == "/v1/models":
            return _json(200, self.models_doc())
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            body = json.loads(await request.aread() or b"{}")
            return await self._generate(body, chat=path.endswith("chat/completions"))
        return _error(404, f"the simulated server has no {method} {path}", None)

    def models_doc(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "flashlane-simulate",
                                            "max_model_len": self.engine.max_model_len, "flashlane": self.info}]}

    async def _generate(self, body: dict, chat: bool) -> httpx.Response:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            return _error(400, "the simulated server needs max_tokens >= 1 (outputs are fixed-length)", "max_tokens")
        try:
            prompt = self.prompts.chat(body["messages"]) if chat else self.prompts.completion(body["prompt"])
        except (KeyError, TypeError, ValueError) as exc:
            return _error(400, f"cannot read the prompt: {exc}", "messages" if chat else "prompt")
        if not prompt or len(prompt) + max_tokens > self.engine.max_model_len:
            return _error(400, f"This model's maximum context length is {self.engine.max_model_len} tokens; the "
                               f"request has {len(prompt)} prompt tokens and asks for {max_tokens} more",
                          "messages" if chat else "prompt")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-sim{next(self._ids)}"
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        events = self._events(rid, queue, prompt, max_tokens, chat)
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Body(events))
        return _json(200, await self._whole(events, rid, chat))

    async def _events(self, rid: str, queue: asyncio.Queue, prompt: list[int], max_tokens: int,
                      chat: bool) -> AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        try:
            start = max(loop.time(), self._admitted_until)
            self._admitted_until = start + self.front_end.admission_s(len(prompt))
            await asyncio.sleep(self._admitted_until - loop.time())
            self.engine.now = loop.time()
            req = self.engine.add_request(rid, prompt, max_tokens)
            self._arrived.set()
            n, done = 0, False
            while not done:
                got, done = await queue.get()
                yield _chunk(rid, self.model, chat, FILLER_TEXT * got, first=n == 0)
                n += got
            yield _chunk(rid, self.model, chat, None, finish="length")
            yield {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "model": self.model,
                   "choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                            "total_tokens": len(prompt) + n,
                                            "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens or 0}}}
        finally:   # a client that went away frees its request at once, as flashlane serve does
            self._streams.pop(rid, None)
            self.engine.abort(rid)

    async def _whole(self, events: AsyncIterator[dict], rid: str, chat: bool) -> dict:
        text, usage = "", None
        async for ev in events:
            usage = ev.get("usage") or usage
            for c in ev["choices"]:
                text += (c.get("delta") or {}).get("content") or c.get("text") or ""
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"} if chat
                  else {"index": 0, "text": text, "finish_reason": "length"})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "model": self.model,
                "choices": [choice], "usage": usage}


class _Body(httpx.AsyncByteStream):
    """Server-sent events of a generation, produced as the simulated engine steps."""

    def __init__(self, events: AsyncIterator[dict]):
        self._events = events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for ev in self._events:
            yield f"data: {json.dumps(ev)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def aclose(self) -> None:
        await self._events.aclose()


def _chunk(rid: str, model: str, chat: bool, text: str | None, first: bool = False,
           finish: str | None = None) -> dict:
    if chat:
        delta = {} if text is None else ({"role": "assistant", "content": text} if first else {"content": text})
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        return {"id": rid, "object": "chat.completion.chunk", "model": model, "choices": [choice]}
    return {"id": rid, "object": "text_completion", "model": model,
            "choices": [{"index": 0, "text": text or "", "finish_reason": finish}]}


def _record(step: SimStep) -> dict:
    """The step in the engine's step-record shape (``/debug/steps``), on the simulation's clock."""
    new = step.seq_new_tokens
    drafts = step.seq_draft_tokens or (0,) * len(new)
    decoding = [n == 1 or d > 0 for n, d in zip(new, drafts)]     # a verify step's sequence decodes
    prefill = sum(n for n, dec in zip(new, decoding) if not dec)
    return {"step": step.step, "start": step.start, "end": step.end, "model_s": step.duration, "sample_s": 0.0,
            "num_seqs": len(new), "num_tokens": sum(new), "prefill_tokens": prefill,
            "decode_tokens": sum(new) - prefill, "decode_seqs": sum(decoding), "num_running": step.num_running,
            "num_waiting": step.num_waiting, "num_preempted": step.num_preempted,
            "request_ids": list(step.request_ids), "seq_new_tokens": list(new),
            "seq_cached_tokens": list(step.seq_cached_tokens), "seq_draft_tokens": list(step.seq_draft_tokens),
            "draft_tokens": sum(step.seq_draft_tokens), "draft_calls": step.draft_calls,
            "draft_rows": step.draft_rows, "draft_logit_rows": step.draft_logit_rows}


def _json(status: int, doc: dict) -> httpx.Response:
    return httpx.Response(status, json=doc)


def _error(status: int, message: str, param: str | None) -> httpx.Response:
    return _json(status, {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                    "code": None}})
