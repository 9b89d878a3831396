"""A small OpenAI-compatible streaming server for bench client tests (runs in a thread).

Tokens are whitespace-separated words (the bench's no-tokenizer approximation), so requested and
reported counts line up. Knobs (mutable at runtime through `FakeServer.cfg`): time to first
token, per-token delay, max running requests (the rest queue and show up as
`flashlane:num_requests_waiting`), error injection, a context limit, early EOS when
ignore_eos is off, and a prefix cache: `cached_tokens` is the longest word prefix shared with an
earlier prompt plus its generated words (all but the last, which never ran through the model),
capped at prompt length - 1 and, with `page_size` set, rounded down to whole pages (the page size
is then advertised like flashlane does, in /v1/models `data[0].flashlane.page_size`).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


@dataclass
class FakeConfig:
    model: str = "fake-model"
    ttft_s: float = 0.005
    token_delay_s: float = 0.001
    max_running: int = 64
    error_every: int = 0  # every Nth completion request fails with HTTP 500
    midstream_error_every: int = 0  # every Nth request sends an error event mid-stream
    max_model_len: int = 100_000
    eos_prob: float = 0.0  # per token, only when ignore_eos is off
    report_usage: bool = True
    cache_bytes_per_token: int = 1536
    tokens_per_chunk: int = 1
    page_size: int | None = None  # None: token-granular cache, no page size advertised
    seed: int = 0


@dataclass
class FakeState:
    running: int = 0
    waiting: int = 0
    count: int = 0
    prompts: list = field(default_factory=list)
    bodies: list = field(default_factory=list)


def _prompt_words(body: dict) -> list[str]:
    if "messages" in body:
        return [w for m in body["messages"] for w in str(m.get("content", "")).split()]
    return str(body.get("prompt", "")).split()


def _cached(entries: list, words: list[str], page_size: int | None) -> int:
    best = 0
    for p in entries:
        n = 0
        for a, b in zip(p, words):
            if a != b:
                break
            n += 1
        best = max(best, n)
    best = max(0, min(best, len(words) - 1))
    return best // page_size * page_size if page_size else best


def make_app(cfg: FakeConfig, state: FakeState) -> FastAPI:
    app = FastAPI()
    sem_holder = {}
    rng = random.Random(cfg.seed)

    def sem():
        if sem_holder.get("n") != cfg.max_running:
            sem_holder["n"], sem_holder["s"] = cfg.max_running, asyncio.Semaphore(cfg.max_running)
        return sem_holder["s"]

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": cfg.model, "object": "model", "owned_by": "fake",
                "metadata": {"cache_bytes_per_token": cfg.cache_bytes_per_token}}
        if cfg.page_size:
            card["flashlane"] = {"page_size": cfg.page_size}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# HELP flashlane:num_requests_running running\n# TYPE flashlane:num_requests_running gauge\n"
            f"flashlane:num_requests_running{{model=\"{cfg.model}\"}} {state.running}\n"
            f"flashlane:num_requests_waiting{{model=\"{cfg.model}\"}} {state.waiting}\n"
            f"flashlane:kv_pages_used {state.running * 3}\nflashlane:kv_pages_free 100\n"
            f"flashlane:requests_total {state.count}\n")

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state.bodies.append(body)
        state.count += 1
        n = state.count
        words = _prompt_words(body)
        if body.get("model") != cfg.model:
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found"}}, 404)
        if len(words) > cfg.max_model_len:
            return JSONResponse({"error": {"message": f"This model's maximum context length is "
                                                      f"{cfg.max_model_len} tokens"}}, 400)
        if cfg.error_every and n % cfg.error_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, 500)
        max_tokens = int(body.get("max_tokens") or 16)
        ignore_eos = bool(body.get("ignore_eos"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        cached = _cached(state.prompts, words, cfg.page_size)
        entry = list(words)  # cached from prefill on; the generated words join it at the end
        state.prompts.append(entry)
        del state.prompts[:-256]
        mid_error = bool(cfg.midstream_error_every and n % cfg.midstream_error_every == 0)
        rid = f"cmpl-{n}"

        def chunk(text=None, finish=None, usage=None):
            if chat:
                choice = {"index": 0, "delta": {"content": text} if text is not None else {},
                          "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
                obj = "text_completion"
            d = {"id": rid, "object": obj, "model": cfg.model, "choices": [] if usage else [choice]}
            if usage:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        async def gen():
            state.waiting += 1
            async with sem():
                state.waiting -= 1
                state.running += 1
                try:
                    await asyncio.sleep(cfg.ttft_s)
                    produced, finish = 0, "length"
                    out_words = []
                    while produced < max_tokens:
                        k = min(cfg.tokens_per_chunk, max_tokens - produced)
                        produced += k
                        piece = [f"tok{(produced - k + i) % 7}" for i in range(k)]
                        out_words += piece
                        yield chunk(" ".join(piece) + " ")
                        if mid_error and produced >= max_tokens // 2:
                            yield f"data: {json.dumps({'error': {'message': 'injected mid-stream'}})}\n\n"
                            return
                        if not ignore_eos and cfg.eos_prob and rng.random() < cfg.eos_prob:
                            finish = "stop"
                            break
                        await asyncio.sleep(cfg.token_delay_s)
                    entry.extend(out_words[:-1])
                    yield chunk(finish=finish)
                    if include_usage and cfg.report_usage:
                        yield chunk(usage={"prompt_tokens": len(words), "completion_tokens": produced,
                                           "total_tokens": len(words) + produced,
                                           "prompt_tokens_details": {"cached_tokens": cached}})
                    yield "data: [DONE]\n\n"
                finally:
                    state.running -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


class FakeServer:
    def __init__(self, cfg: FakeConfig | None = None, port: int | None = None):
        self.cfg = cfg or FakeConfig()
        self.state = FakeState()
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(make_app(self.cfg, self.state), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "FakeServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def reset(self, **cfg) -> None:
        """Back to defaults (plus overrides) between tests."""
        fresh = FakeConfig(**cfg)
        for k, v in vars(fresh).items():
            setattr(self.cfg, k, v)
        self.state.prompts.clear()
        self.state.bodies.clear()
        self.state.count = 0


def main() -> None:
    """As a process (like a real server): python tests/bench_fake_server.py --port P --model M.
    A model name containing "slow" decodes 10x slower (for compare tests)."""
    import argparse
    import signal

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--ttft", type=float, default=0.005)
    p.add_argument("--token-delay", type=float, default=0.001)
    p.add_argument("--cache-bytes-per-token", type=int, default=1536)
    a = p.parse_args()
    delay = a.token_delay * (10 if "slow" in a.model else 1)
    srv = FakeServer(FakeConfig(model=a.model, ttft_s=a.ttft, token_delay_s=delay,
                                cache_bytes_per_token=a.cache_bytes_per_token), port=a.port)
    signal.signal(signal.SIGTERM, lambda *_: setattr(srv.server, "should_exit", True))
    srv.server.run()


if __name__ == "__main__":
    main()
