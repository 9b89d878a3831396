"""Measure the front end of ``flashlane serve`` on this machine (``flashlane calibrate``).

Starts the server with the engine flags being calibrated, sends chat requests one at a time (so
the engine is idle when each arrives) with prompts of a few lengths, reads the engine's step
records with their request ids, and fits ``front_end.FrontEnd``: the delay from a request's send
to the start of its first step (by prompt length), from the end of each step that made a token
to the token's arrival, the engine's pause between the back-to-back steps of one request, and
how much slower the served steps run than the fitted model of the engine alone predicts.
All times are on one clock: the step records' wall clock, mapped onto the client's monotonic one.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ..bench.server_launch import ServerProcess, free_port, serve_command
from ..bench.text_synth import TextSynth
from ..analyze.step_cost import StepShape
from .front_end import FrontEnd, RequestTiming, fit, served_scales

PROMPT_TOKENS = (64, 512, 2048, 6144)
REPEATS = 3
OUTPUT_TOKENS = 8


def _stream(client: httpx.Client, model: str, text: str) -> tuple[str, float, list[float], int, int]:
    """One streamed chat request: (response id, send time, token chunk arrival times, prompt
    tokens, generated tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": OUTPUT_TOKENS,
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
                      predict: Callable[[StepShape], float] | None = None) -> FrontEnd:
    """``predict``: the fitted step-cost model of the engine alone; the served steps' times against
    it give the served-step scales (1.0 without it)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="flashlane-calibrate-") as tmp, \
            ServerProcess(serve_command(model, port, None, serve_args), base, Path(tmp) / "serve.log") as srv, \
            httpx.Client(base_url=base, timeout=600.0) as client:
        log(f"front end: flashlane serve (pid {srv.pid}), {len(prompt_tokens)} prompt lengths x {repeats}")
        _stream(client, model, synth.text(16, "warm-up"))
        wall_minus_perf = time.time() - time.perf_counter()
        since = time.time()
        sent = [_stream(client, model, synth.text(n, "front-end", n, r)) for n in prompt_tokens for r in range(repeats)]
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
    scales = (1.0, 1.0)
    if predict is not None:
        served = []
        for s in steps:
            shape = StepShape.from_record(s)
            served.append((bool(shape.prefill), s["end"] - s["start"], predict(shape)))
        scales = served_scales(served)
        log(f"front end: served steps take {scales[0]:.3f}x (prefill) and {scales[1]:.3f}x (decode) the "
            "engine alone's fitted time")
    return fit(timings, [g for g in gaps if g >= 0],
               f"measured by flashlane calibrate: {len(timings)} chat requests to flashlane serve "
               f"({', '.join(map(str, prompt_tokens))} prompt words x {repeats}), engine step records",
               scales)
