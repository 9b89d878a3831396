"""Measure the front end of ``flashlane serve`` on this machine (``flashlane calibrate``).

Starts the server with the engine flags being calibrated, sends chat requests one at a time (so
the engine is idle when each arrives) with prompts of a few lengths, reads the engine's step
records with their request ids, and fits ``front_end.FrontEnd``: the delay from a request's send
to the start of its first step (by prompt length), from the end of each step that made a token
to the token's arrival, the engine's pause between the back-to-back steps of one request, and
how much slower the served steps run than the fitted model of the engine alone predicts.
Then, for a concurrency above 1, a few waves of that many streams at once: how much slower
still the served steps run with more requests in flight (the contention).
All times are on one clock: the step records' wall clock, mapped onto the client's monotonic one.

The served steps are set against the fit like for like: the server first runs the warm-up the
grid's engine ran (``calibrate.warm_up``: 64 decode steps, then one batch of the largest size), and
each measured request generates as many tokens as each of the grid's requests. Decode steps right
after a prefill run slower than later ones (tiny-standard, static graphs, float32: 1.3x, 1.15x,
1.08x for the first three, then within 5%), and the fit prices them at the grid's mix of
positions; measured with 8 tokens after a 16-token warm-up, served decode steps came out 1.15x the
fit while the same server's steps in `compare` ran 0.96x it (2026-12-07, Emerald Rapids).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from ..bench.server_launch import ServerProcess, free_port, serve_command
from ..bench.text_synth import TextSynth
from ..analyze.step_cost import StepShape
from .front_end import FrontEnd, RequestTiming, fit, served_contention, served_scales

PROMPT_TOKENS = (64, 512, 2048, 6144)
REPEATS = 3
OUTPUT_TOKENS = 12           # calibrate's default --decode-tokens
WARM_UP_TOKENS = 64          # calibrate.warm_up's: a fresh engine's first decode steps run slow
WARM_UP_BATCH_TOKENS = 8
# the contention waves: prompts of these lengths in turn, long enough answers for batched decodes
CONCURRENT_PROMPT_TOKENS = (512, 2048)
CONCURRENT_WAVES = 2
CONCURRENT_OUTPUT_TOKENS = 24


def _stream(client: httpx.Client, model: str, text: str,
            max_tokens: int = OUTPUT_TOKENS) -> tuple[str, float, list[float], int, int]:
    """One streamed chat request: (response id, send time, token chunk arrival times, prompt
    tokens, generated tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    rid, arrivals, prompt, tokens = None, [], 0, 0
    send = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            t = time.perf_counter()
            chunk = json.loads(line[5:])
            rid = rid or chunk.get("id")
            if chunk.get("usage"):
                prompt, tokens = chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"]
            choice = (chunk.get("choices") or [{}])[0]
            if isinstance((choice.get("delta") or {}).get("content"), str):   # the last one carries the finish too
                arrivals.append(t)
    return rid, send, arrivals, prompt, tokens


def measure_front_end(model: str, serve_args: list[str], synth: TextSynth, log=print,
                      prompt_tokens: tuple[int, ...] = PROMPT_TOKENS, repeats: int = REPEATS,
                      predict: Callable[[StepShape], float] | None = None, concurrency: int = 1,
                      output_tokens: int = OUTPUT_TOKENS) -> FrontEnd:
    """``predict``: the fitted step-cost model of the engine alone; the served steps' times against
    it give the served-step scales (1.0 without it) and, with ``concurrency`` above 1, the
    contention of that many requests in flight. ``output_tokens``: per measured request, the
    tokens each request of the fitted grid generated."""
    if concurrency < 1:
        raise ValueError(f"front end: concurrency must be >= 1, got {concurrency}")
    if output_tokens < 2:
        raise ValueError(f"front end: output_tokens must be >= 2 (a decode step per request), got {output_tokens}")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="flashlane-calibrate-") as tmp, \
            ServerProcess(serve_command(model, port, None, serve_args), base, Path(tmp) / "serve.log") as srv, \
            httpx.Client(base_url=base, timeout=600.0) as client:
        log(f"front end: flashlane serve (pid {srv.pid}), {len(prompt_tokens)} prompt lengths x {repeats}")
        _stream(client, model, synth.text(64, "warm-up"), WARM_UP_TOKENS)
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda i: _stream(client, model, synth.text(64, "warm-up", i), WARM_UP_BATCH_TOKENS),
                          range(concurrency)))
        wall_minus_perf = time.time() - time.perf_counter()
        since = time.time()
        sent = [_stream(client, model, synth.text(n, "front-end", n, r), output_tokens)
                for n in prompt_tokens for r in range(repeats)]
        concurrent_since = time.time()
        if concurrency > 1 and predict is not None:
            log(f"front end: {CONCURRENT_WAVES} waves of {concurrency} requests at once")
            with ThreadPoolExecutor(concurrency) as pool:
                for wave in range(CONCURRENT_WAVES):
                    texts = [synth.text(CONCURRENT_PROMPT_TOKENS[i % len(CONCURRENT_PROMPT_TOKENS)],
                                        "front-end-concurrent", wave, i) for i in range(concurrency)]
                    list(pool.map(lambda t: _stream(client, model, t, CONCURRENT_OUTPUT_TOKENS), texts))
        steps = client.get("/debug/steps", params={"since": since, "request_ids": True}).json()["steps"]
    by_request: dict[str, list[dict]] = {}
    for s in steps:
        for rid in s["request_ids"]:
            by_request.setdefault(rid, []).append(s)
    timings, gaps = [], []
    for rid, send, arrivals, prompt, tokens in sent:
        mine = sorted(by_request.get(f"{rid}-0", []), key=lambda s: s["start"])
        if not mine or not tokens or len(mine) < tokens:
            continue
        made = mine[-tokens:]            # the steps that sampled: the prompt's last chunk, then the decodes
        delays = (tuple(a - (s["end"] - wall_minus_perf) for a, s in zip(arrivals, made))
                  if len(arrivals) == tokens else ())
        timings.append(RequestTiming(prompt, send, mine[0]["start"] - wall_minus_perf, delays))
        gaps += [b["start"] - a["end"] for a, b in zip(made, made[1:])]
    scales, contention, most = (1.0, 1.0), (0.0, 0.0), 1
    if predict is not None:
        alone, together = [], []
        for s in steps:
            shape = StepShape.from_record(s)
            served = (bool(shape.prefill), shape.num_seqs, s["end"] - s["start"], predict(shape))
            (together if s["start"] >= concurrent_since else alone).append(served)
        scales = served_scales([(p, m, q) for p, _, m, q in alone])
        log(f"front end: served steps take {scales[0]:.3f}x (prefill) and {scales[1]:.3f}x (decode) the "
            "engine alone's fitted time")
        if together:
            contention, most = served_contention(together, scales), max(n for _, n, _, _ in together)
            log(f"front end: with up to {most} sequences per step, {contention[0]:+.3f}x (prefill) and "
                f"{contention[1]:+.3f}x (decode) more per additional sequence")
    waves = (f"; {CONCURRENT_WAVES} waves of {concurrency} at once" if most > 1 else "")
    return fit(timings, [g for g in gaps if g >= 0],
               f"measured by flashlane calibrate: {len(timings)} chat requests to flashlane serve "
               f"({', '.join(map(str, prompt_tokens))} prompt words x {repeats}, {output_tokens} tokens each, "
               f"after a warm-up of {WARM_UP_TOKENS} tokens and {concurrency} at once){waves}, engine step records",
               scales, contention, most)
