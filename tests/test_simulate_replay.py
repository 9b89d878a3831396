"""The serving simulator at library level: the virtual-time loop, the simulated OpenAI server
(streaming, usage, prefix-cache hits, errors, front-end time), the prompt tokenizer it uses, the
front-end fit, bench's own replay against it (`simulate_bench`: run folders, step costs,
determinism, one engine across load points), calibrated set-ups, stack mechanisms and the
engine-flag round trip. Cost functions are plain lambdas: nothing here measures real time."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path

import httpx
import pytest

from flashlane import presets
from flashlane.analyze.calibration import Calibration
from flashlane.analyze.models import resolve_model
from flashlane.analyze.step_cost import TERMS, StepShape
from flashlane.bench import clock
from flashlane.bench.client import OVERFLOW_RE, classify_http_error
from flashlane.bench.stack_files import Mechanisms
from flashlane.cli.engine_flags import engine_kwargs_of_flags, flags_of_engine_kwargs
from flashlane.simulate import run as run_mod
from flashlane.simulate import setup as sim_setup
from flashlane.simulate.front_end import FrontEnd, RequestTiming, fit, served_contention, served_scales
from flashlane.simulate.prompts import ROLE_IDS, PromptTokenizer, prompt_tokenizer
from flashlane.simulate.run import SimSetup, sim_bench_config, simulate_bench
from flashlane.simulate.sim_engine import SimEngine
from flashlane.simulate.sim_server import SimServer
from flashlane.simulate.virtual_time import SimulationStalled, run_virtual

MODEL = "tiny-flash"


@functools.lru_cache(maxsize=None)
def _cfg(name: str = MODEL):
    return resolve_model(name).cfg


@functools.lru_cache(maxsize=None)
def _prompts() -> PromptTokenizer:
    return prompt_tokenizer(MODEL, _cfg().vocab_size)


def _words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


# ---- 1. virtual time ---------------------------------------------------------------------------
def test_virtual_sleeps_jump_the_clock_to_exactly_the_scheduled_times():
    seen = []

    async def main():
        loop = asyncio.get_running_loop()
        seen.append((loop.time(), clock.now()))
        await asyncio.sleep(1.5)
        seen.append((loop.time(), clock.now()))
        await asyncio.sleep(3600)
        seen.append((loop.time(), clock.now()))
        await asyncio.wait_for(asyncio.sleep(0.25), timeout=10)
        seen.append((loop.time(), clock.now()))
        return "done"

    assert run_virtual(main()) == "done"
    expected = [0.0, 1.5, 3601.5, 3601.75]
    assert [loop_t for loop_t, _ in seen] == pytest.approx(expected, abs=1e-9)
    # the bench clock is the loop's clock for the duration of the run
    assert [bench_t for _, bench_t in seen] == pytest.approx(expected, abs=1e-9)


def test_virtual_time_starts_where_asked_and_concurrent_timers_interleave():
    order = []

    async def sleeper(name: str, delay: float):
        await asyncio.sleep(delay)
        order.append((name, clock.now()))

    async def main():
        t0 = clock.now()
        await asyncio.gather(sleeper("late", 2.0), sleeper("early", 0.5))
        return t0

    t0 = run_virtual(main(), start=1000.0)
    assert t0 == pytest.approx(1000.0, abs=1e-9)
    assert [n for n, _ in order] == ["early", "late"]
    assert [t for _, t in order] == pytest.approx([1000.5, 1002.0], abs=1e-9)


def test_waiting_for_what_never_comes_is_a_stall_and_the_real_clock_comes_back():
    async def main():
        await asyncio.Event().wait()

    with pytest.raises(SimulationStalled):
        run_virtual(main(), start=5e6)
    # the bench clock reads real time again (not the abandoned loop's 5e6)
    before = time.perf_counter()
    t = clock.now()
    after = time.perf_counter()
    assert before <= t <= after

    async def short():
        await asyncio.sleep(7.0)
        return clock.now()

    assert run_virtual(short(), start=5e6) == pytest.approx(5e6 + 7.0, abs=1e-6)
    before = time.perf_counter()
    t = clock.now()
    assert before <= t <= time.perf_counter()


# ---- 2. the simulated server -------------------------------------------------------------------
ENGINE = dict(page_size=16, num_pages=256, max_num_batched_tokens=64)
STEP_S = 0.01


def _serve(client_fn, front_end: FrontEnd = FrontEnd(), cost: float = STEP_S, **engine_args):
    """Run ``client_fn(client)`` against a fresh SimServer (constant step cost) in virtual time;
    returns (server, what client_fn returned)."""
    engine = SimEngine(_cfg(), lambda shape: cost, **{**ENGINE, **engine_args})
    server = SimServer(engine, _prompts(), front_end, MODEL)

    async def main():
        server.start()
        async with httpx.AsyncClient(transport=server, base_url="http://simulated") as client:
            return await client_fn(client)

    return server, run_virtual(main())


async def _stream(client: httpx.AsyncClient, path: str, body: dict):
    """(send time, arrival time of each content chunk, every SSE event) of one streamed request."""
    sent, arrivals, events = clock.now(), [], []
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[len("data: "):])
            events.append(ev)
            choice = ev["choices"][0] if ev["choices"] else {}
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                arrivals.append(clock.now())
    return sent, arrivals, events


def _prefill_steps(server: SimServer, rid: str, prompt_len: int) -> list[dict]:
    """The steps that computed ``rid``'s prompt (the last one samples its first token)."""
    out = []
    for s in server.steps:
        if rid in s["request_ids"]:
            i = s["request_ids"].index(rid)
            if s["seq_cached_tokens"][i] < prompt_len:
                out.append(s)
    return out


MESSAGES = [{"role": "system", "content": "You are a careful coding agent."},
            {"role": "user", "content": "Read the repository and fix the failing test. " + _words(110)}]


def test_a_streamed_chat_request_gets_its_tokens_one_step_apart_then_its_usage():
    max_tokens = 5
    server, (sent, arrivals, events) = _serve(
        lambda c: _stream(c, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": max_tokens}))
    prompt_len = len(_prompts().chat(MESSAGES))
    content = [ev for ev in events if ev["choices"] and ev["choices"][0]["delta"].get("content")]
    assert len(content) == max_tokens == len(arrivals)
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in ev["choices"][0]["delta"] for ev in content[1:])
    finish = [ev["choices"][0]["finish_reason"] for ev in events if ev["choices"]]
    assert finish[-1] == "length" and finish[:-1] == [None] * max_tokens
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == []
    assert usage["prompt_tokens"] == prompt_len and usage["completion_tokens"] == max_tokens
    assert usage["total_tokens"] == prompt_len + max_tokens

    rid = events[0]["id"]
    prefill = _prefill_steps(server, rid, prompt_len)
    assert len(prefill) >= 2, "a prompt longer than the step budget is prefilled in chunks"
    assert sum(s["seq_new_tokens"][s["request_ids"].index(rid)] for s in prefill) == prompt_len
    # zero front end, constant step cost: the first token after the prefill steps, then one per step
    assert arrivals[0] - sent == pytest.approx(len(prefill) * STEP_S, abs=1e-9)
    assert [b - a for a, b in zip(arrivals, arrivals[1:])] == pytest.approx([STEP_S] * (max_tokens - 1), abs=1e-9)
    assert all(s["end"] - s["start"] == pytest.approx(STEP_S, abs=1e-12) for s in server.steps)
    assert len(server.steps) == len(prefill) + max_tokens - 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_follow_up_turn_reports_cached_prompt_tokens_only_with_the_prefix_cache(prefix_caching):
    async def two_turns(client):
        r1 = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
        answer = r1.json()["choices"][0]["message"]["content"]
        follow = MESSAGES + [{"role": "assistant", "content": answer},
                             {"role": "user", "content": "Now run the tests again."}]
        r2 = await client.post("/v1/chat/completions", json={"messages": follow, "max_tokens": 3})
        return r1.json(), r2.json(), follow

    _, (first, second, follow) = _serve(two_turns, enable_prefix_caching=prefix_caching)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens"] == len(_prompts().chat(follow))
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    if prefix_caching:
        assert 0 < cached <= first["usage"]["prompt_tokens"]
    else:
        assert cached == 0


def test_non_streamed_answers_and_http_errors_are_what_the_bench_expects():
    async def calls(client):
        out = {}
        out["health"] = await client.get("/health")
        out["models"] = await client.get("/v1/models")
        out["chat"] = await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
        out["completion"] = await client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 2})
        out["overflow"] = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": _words(4200)}], "max_tokens": 8})
        out["overflow_ids"] = await client.post("/v1/completions", json={
            "prompt": [7] * 4095, "max_tokens": 8})
        out["unknown_get"] = await client.get("/v1/nothing-here")
        out["unknown_post"] = await client.post("/v1/embeddings", json={"input": "x"})
        out["no_max_tokens"] = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
        out["zero_max_tokens"] = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
        return out

    server, r = _serve(calls)
    assert r["health"].status_code == 200
    models = r["models"].json()["data"]
    assert models[0]["id"] == MODEL and models[0]["max_model_len"] == 16 * 256 == server.engine.max_model_len

    chat = r["chat"].json()
    assert r["chat"].status_code == 200 and chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": " w" * 3}
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["prompt_tokens"] == len(_prompts().chat(MESSAGES))
    assert chat["usage"]["completion_tokens"] == 3
    comp = r["completion"].json()
    assert comp["choices"][0]["text"] == " w" * 2
    assert comp["usage"]["prompt_tokens"] == len(_prompts().completion("def f(x):"))

    for key in ("overflow", "overflow_ids"):
        resp = r[key]
        assert resp.status_code == 400, key
        err = resp.json()["error"]
        assert OVERFLOW_RE.search(err["message"]), err
        assert classify_http_error(400, resp.text) == "context_overflow"
    for key in ("unknown_get", "unknown_post"):
        assert r[key].status_code == 404 and "error" in r[key].json()
    for key in ("no_max_tokens", "zero_max_tokens"):
        err = r[key].json()["error"]
        assert r[key].status_code == 400 and err["param"] == "max_tokens" and "max_tokens" in err["message"]
        assert classify_http_error(400, r[key].text) != "context_overflow"
    # only the two served generations reached the engine
    assert {rid for s in server.steps for rid in s["request_ids"]} == {chat["id"], comp["id"]}


def test_a_boolean_max_tokens_is_a_400_naming_max_tokens():
    async def call(client):
        return await client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": True})

    _, r = _serve(call)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_front_end_time_delays_admission_and_each_token():
    body = {"messages": MESSAGES, "max_tokens": 4}
    prompt_len = len(_prompts().chat(MESSAGES))
    _, (s0, a0, _) = _serve(lambda c: _stream(c, "/v1/chat/completions", body))
    fe = FrontEnd(request_s=0.5, per_prompt_token_s=1e-3, token_s=0.25)
    _, (s1, a1, _) = _serve(lambda c: _stream(c, "/v1/chat/completions", body), front_end=fe)
    ttft0, ttft1 = a0[0] - s0, a1[0] - s1
    assert ttft1 >= ttft0 + 0.5
    assert ttft1 == pytest.approx(ttft0 + 0.5 + 1e-3 * prompt_len + 0.25, abs=1e-9)
    # the token delay shifts every token alike: inter-token gaps are the steps' own
    assert [b - a for a, b in zip(a1, a1[1:])] == pytest.approx([b - a for a, b in zip(a0, a0[1:])], abs=1e-9)


def test_admission_is_serial_as_in_the_one_api_process():
    """Three requests sent at once reach the engine one admission time apart, so the first step
    holds the first alone (with admission in parallel all three would share it)."""
    body = {"messages": MESSAGES, "max_tokens": 2}
    prompt_len = len(_prompts().chat(MESSAGES))
    fe = FrontEnd(request_s=0.5, per_prompt_token_s=1e-3)
    admit = 0.5 + 1e-3 * prompt_len

    async def burst(client):
        return await asyncio.gather(*(_stream(client, "/v1/chat/completions", body) for _ in range(3)))

    # a step far longer than admission, a budget that takes each whole prompt at once
    server, streams = _serve(burst, front_end=fe, cost=10.0, max_num_batched_tokens=4096)
    sent = min(st for st, _, _ in streams)
    first, second = server.steps[0], server.steps[1]
    assert first["start"] == pytest.approx(sent + admit, abs=1e-6)
    assert len(first["request_ids"]) == 1         # the first alone: the others were still being admitted
    assert set(first["request_ids"]) < set(second["request_ids"]) and len(second["request_ids"]) == 3
    assert second["start"] == pytest.approx(first["end"], abs=1e-6)


def test_a_developer_message_is_served_as_flashlane_serve_serves_it():
    msgs = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]

    async def call(client):
        return await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2})

    _, r = _serve(call)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] == len(_prompts().chat([{**msgs[0], "role": "system"}, msgs[1]]))


# ---- 3. prompt tokens ---------------------------------------------------------------------------
def test_prompt_ids_of_a_preset_are_its_chat_template_then_its_tokenizer():
    from flashlane.models.registry import preset_folder
    from flashlane.models.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(preset_folder(MODEL))
    pt = _prompts()
    assert pt.exact
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Open src/app.py and explain it."},
            {"role": "assistant", "content": "It defines main()."},
            {"role": "user", "content": [{"type": "text", "text": "Now "}, {"type": "text", "text": "refactor it."}]}]
    dicts = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
              else "".join(p["text"] for p in m["content"])} for m in msgs]
    expected = tok.encode(tok.apply_chat_template(dicts, add_generation_prompt=True))
    assert pt.chat(msgs) == expected
    assert pt.chat(msgs[:2]) == tok.encode(tok.apply_chat_template(dicts[:2], add_generation_prompt=True))
    assert pt.completion("def main():\n    pass") == tok.encode("def main():\n    pass")
    assert pt.completion([5, 6, 7]) == [5, 6, 7]


def test_the_one_word_one_id_approximation(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)     # nothing in the working directory to pick up
    vocab = _cfg("glm-5.3-flash").vocab_size
    full = prompt_tokenizer("glm-5.3-flash", vocab)
    assert not full.exact
    pt = PromptTokenizer(None, vocab_size=1000)
    base = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha beta gamma"}]
    assert pt.chat(base) == pt.chat([dict(m) for m in base]) == PromptTokenizer(None, 1000).chat(base)
    assert pt.chat(base) != pt.chat([base[0], {"role": "user", "content": "alpha beta delta"}])
    for n in (0, 1, 7, 40):
        longer = base + [{"role": "assistant", "content": _words(n, "t")}]
        assert len(pt.chat(longer)) - len(pt.chat(base)) == n + ROLE_IDS
        assert pt.chat(longer)[:len(pt.chat(base)) - 1] == pt.chat(base)[:-1]   # a shared prefix
    ids = pt.chat(base + [{"role": "user", "content": _words(500)}]) + pt.completion(_words(300, "z"))
    assert all(3 <= i < 1000 for i in ids)
    assert len(pt.completion("one two  three\nfour")) == 4


def test_a_named_full_size_config_ignores_a_tokenizer_in_the_working_directory(tmp_path, monkeypatch):
    from flashlane.models.registry import preset_folder

    (tmp_path / "tokenizer.json").write_bytes((preset_folder(MODEL) / "tokenizer.json").read_bytes())
    monkeypatch.chdir(tmp_path)
    assert not prompt_tokenizer("glm-5.3-flash", _cfg("glm-5.3-flash").vocab_size).exact


# ---- 4. front-end fit ---------------------------------------------------------------------------
def _timings(tokens, admission, delays=(0.001, 0.003, 0.002)):
    return [RequestTiming(n, 10.0 * i, 10.0 * i + admission(n), tuple(delays)) for i, n in enumerate(tokens)]


def test_front_end_fit_recovers_exact_synthetic_terms():
    reqs = _timings([10, 100, 500, 1000, 2000, 4000], lambda n: 0.004 + 2e-6 * n)
    fe = fit(reqs, [0.0005, 0.0001, 0.0009, 0.0004, 0.0007], "synthetic")
    assert fe.request_s == pytest.approx(0.004, rel=1e-6)
    assert fe.per_prompt_token_s == pytest.approx(2e-6, rel=1e-6)
    assert fe.token_s == pytest.approx(0.002, abs=1e-12)      # median of the token delays
    assert fe.step_gap_s == pytest.approx(0.0005, abs=1e-12)  # median of the step gaps
    assert fe.source == "synthetic"
    assert fe.admission_s(1000) == pytest.approx(0.006, rel=1e-6)
    # negative token delays (clock noise) are not medians' material
    fe = fit(_timings([10, 20], lambda n: 0.001, delays=(-0.5, -0.4, 0.003)), [], "x")
    assert fe.token_s == pytest.approx(0.003, abs=1e-12) and fe.step_gap_s == 0


def test_front_end_fit_never_returns_negative_terms():
    # a line with a negative intercept: refit through the origin, both terms >= 0
    fe = fit(_timings([200, 400, 800], lambda n: -0.01 + 1e-4 * n), [], "neg intercept")
    assert fe.request_s == 0 and fe.per_prompt_token_s > 0
    assert fe.admission_s(400) == pytest.approx(sum(
        (-0.01 + 1e-4 * n) * n for n in (200, 400, 800)) / sum(n * n for n in (200, 400, 800)) * 400, rel=1e-9)
    # admission shrinking with the prompt: no negative slope, the mean as the fixed part
    fe = fit(_timings([100, 200, 300], lambda n: 0.05 - 1e-4 * n), [], "neg slope")
    assert fe.per_prompt_token_s == 0 and fe.request_s == pytest.approx(0.03, rel=1e-9)
    # a request seen in the engine before its send (clock skew) counts as no delay
    fe = fit([RequestTiming(10, 5.0, 4.0, ()), RequestTiming(20, 6.0, 5.5, ())], [], "skew")
    assert fe.request_s >= 0 and fe.per_prompt_token_s >= 0 and fe.token_s == 0
    # all prompts alike: no slope to fit
    fe = fit(_timings([64, 64, 64], lambda n: 0.02), [], "flat")
    assert fe.per_prompt_token_s == 0 and fe.request_s == pytest.approx(0.02, rel=1e-9)


def test_front_end_fit_and_fields_refuse_what_they_cannot_use():
    with pytest.raises(ValueError, match="at least 2"):
        fit(_timings([100], lambda n: 0.01), [], "one")
    with pytest.raises(ValueError, match="at least 2"):
        fit([], [], "none")
    with pytest.raises(ValueError, match="bogus"):
        FrontEnd.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="token_s"):
        FrontEnd(token_s=-0.001)
    with pytest.raises(ValueError, match="request_s"):
        FrontEnd.from_dict({"request_s": -1.0})
    with pytest.raises(ValueError, match="step_gap_s"):
        FrontEnd(step_gap_s=float("nan"))
    assert FrontEnd.from_dict(None) == FrontEnd() == FrontEnd.from_dict({})
    fe = FrontEnd(0.01, 1e-6, 0.002, 0.0003, "measured")
    assert FrontEnd.from_dict(fe.to_dict()) == fe
    assert fe.zero().admission_s(10_000) == 0 and fe.zero().token_s == 0 and fe.zero().step_gap_s == 0
    with pytest.raises(ValueError, match="served_decode_scale"):
        FrontEnd(served_decode_scale=0.0)


def test_served_step_scales_are_ratios_of_sums_by_step_kind():
    steps = [(True, 1.2, 1.0), (True, 2.2, 2.0), (False, 0.011, 0.01), (False, 0.033, 0.03)]
    assert served_scales(steps) == pytest.approx((3.4 / 3.0, 0.044 / 0.04))
    assert served_scales([(False, 0.02, 0.01)]) == pytest.approx((1.0, 2.0))     # no prefill steps: 1.0
    fe = fit(_timings([100, 200], lambda n: 0.01), [], "x", scales=(1.1, 1.3))
    assert fe.step_scale(True) == 1.1 and fe.step_scale(False) == 1.3
    assert FrontEnd.from_dict(fe.to_dict()) == fe and fe.zero().step_scale(True) == 1.0


def test_served_contention_is_fitted_per_step_kind_and_held_beyond_what_was_measured():
    scales = (1.2, 1.1)
    c_prefill, c_decode = 0.01, 0.04
    steps = [(p, n, pred * (scales[0] if p else scales[1]) * (1 + (c_prefill if p else c_decode) * (n - 1)), pred)
             for p, n, pred in [(True, 3, 0.5), (False, 4, 0.05), (False, 2, 0.04), (True, 1, 0.3), (False, 4, 0.06),
                                (True, 8, 0.7)]]
    assert served_contention(steps, scales) == pytest.approx((c_prefill, c_decode), rel=1e-9)
    decode_only = [s for s in steps if not s[0]]
    assert served_contention(decode_only, scales) == pytest.approx((0.0, c_decode), rel=1e-9)  # no prefill: none
    assert served_contention([(False, 1, 0.02, 0.01)], scales) == (0.0, 0.0)    # nothing batched: nothing to fit
    assert served_contention([], scales) == (0.0, 0.0)
    fe = fit(_timings([100, 200], lambda n: 0.01), [], "x", scales=scales, contention=(c_prefill, c_decode),
             contention_seqs=4)
    assert fe.step_scale(False) == fe.step_scale(False, 1) == pytest.approx(1.1)
    assert fe.step_scale(True, 3) == pytest.approx(1.2 * (1 + 2 * c_prefill))
    assert fe.step_scale(False, 3) == pytest.approx(1.1 * (1 + 2 * c_decode))
    assert fe.step_scale(False, 9) == fe.step_scale(False, 4) == pytest.approx(1.1 * (1 + 3 * c_decode))  # held at 4
    assert FrontEnd.from_dict(fe.to_dict()) == fe and fe.zero().step_scale(True, 4) == 1.0
    # a strongly negative fit never makes a served step less than half the one-at-a-time time
    assert FrontEnd(served_decode_contention=-1.0, served_contention_seqs=8).step_scale(False, 8) == 0.5
    # a front end measured before the contention existed reads as none
    old = {k: v for k, v in fe.to_dict().items() if "contention" not in k}
    assert FrontEnd.from_dict(old).step_scale(False, 4) == pytest.approx(1.1)
    # calibration method 2 fitted one contention over both kinds: it reads as both
    one = {**old, "served_contention": 0.03, "served_contention_seqs": 4}
    assert FrontEnd.from_dict(one).step_scale(True, 2) == pytest.approx(1.2 * 1.03)
    assert FrontEnd.from_dict(one).step_scale(False, 2) == pytest.approx(1.1 * 1.03)
    with pytest.raises(ValueError, match="served_contention_seqs"):
        FrontEnd(served_contention_seqs=0)
    with pytest.raises(ValueError, match="served_prefill_contention must"):
        FrontEnd(served_prefill_contention=float("nan"))
    with pytest.raises(ValueError, match="served_decode_contention must"):
        FrontEnd(served_decode_contention=float("inf"))


# ---- 5. bench's replay against the simulated server ----------------------------------------------
def _cost(shape: StepShape) -> float:
    return 0.002 + 1e-5 * shape.num_tokens + 1e-4 * len(shape.decode)


def _slow_cost(shape: StepShape) -> float:
    return 3 * _cost(shape)


def _simulate(out: Path, cost=_cost, front_end: FrontEnd = FrontEnd(), seed: int = 0):
    setup = SimSetup(MODEL, _cfg(), cost, {}, _prompts(), front_end)
    cfg = sim_bench_config(output_dir=str(out), workload="agentic", scale="small", concurrency=[1, 2],
                           num_sessions=2, seed=seed, tokenizer=MODEL, progress=False)
    return simulate_bench(setup, cfg, out, resolve_tokenizer=presets.tokenizer_file)


def _recorded_simulation(out: Path, **kw):
    """simulate_bench, keeping each load point's SimServer."""
    servers = []

    class Recording(SimServer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            servers.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_mod, "SimServer", Recording)
        results = _simulate(out, **kw)
    return results, servers


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    _prompts()   # the preset (and its tokenizer.json) exists before the bench resolves it
    return _recorded_simulation(tmp_path_factory.mktemp("simulate") / "base")


def test_simulate_bench_writes_bench_run_folders_with_the_simulated_steps(bench_run):
    results, servers = bench_run
    assert [p.label for p, _, _ in results] == ["c1", "c2"] and len(servers) == 2
    for (point, summary, folder), server in zip(results, servers):
        assert folder.name == point.label
        for name in ("manifest.json", "requests.jsonl", "sessions.jsonl", "summary.json",
                     "telemetry/engine_steps.jsonl"):
            assert (folder / name).is_file(), name
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["clock"] == "simulated seconds (virtual time)"
        sim = manifest["simulation"]
        assert sim["front_end"] == FrontEnd().to_dict() and sim["engine_args"] == {}
        assert sim["prompt_tokens"] == _prompts().source
        assert manifest["server_command"] is None and manifest["load_point"]["concurrency"] == int(point.label[1])
        requests, sessions = _jsonl(folder / "requests.jsonl"), _jsonl(folder / "sessions.jsonl")
        assert requests and all(r["status"] == "ok" and r["usage_reported"] for r in requests)
        assert all(r["output_tokens"] == r["requested_output_tokens"] for r in requests)
        whole = [s for s in sessions if s["phase"] == "profiling" and s["completed"] and not s["truncated"]]
        on_disk = json.loads((folder / "summary.json").read_text())
        assert len(whole) == 2 == on_disk["task_latency_s"]["n"]      # --num-sessions 2: two whole tasks
        assert on_disk["task_latency_s"]["mean"] > 0
        assert on_disk["task_latency_s"]["mean"] == pytest.approx(summary["task_latency_s"]["mean"], rel=1e-12)
        assert on_disk["telemetry"]["utilisation_source"] == "engine.steps"

        steps = _jsonl(folder / "telemetry" / "engine_steps.jsonl")
        assert len(steps) == len(server.steps) > 0
        assert [s["step"] for s in steps] == [s["step"] for s in server.steps]
        # each step lasted exactly what the cost function says of its recorded composition
        assert sum(s["end"] - s["start"] for s in steps) == pytest.approx(
            sum(_cost(StepShape.from_record(s)) for s in steps), rel=1e-9)
        for s in steps:
            assert s["end"] - s["start"] == pytest.approx(_cost(StepShape.from_record(s)), abs=1e-12)
            assert s["num_tokens"] == sum(s["seq_new_tokens"])
        assert all(a["end"] <= b["start"] + 1e-12 for a, b in zip(steps, steps[1:]))
        # every request's prompt went through the engine: the sum of new tokens covers the prompts
        computed = sum(n for s in steps for n in s["seq_new_tokens"] if n > 1)
        prompts = sum(r["input_tokens"] - (r["cached_tokens"] or 0) for r in requests)
        assert computed >= prompts - len(requests)     # a 1-token remainder computes as a decode row


def test_the_second_load_point_continues_the_first_ones_engine_and_clock(bench_run):
    results, servers = bench_run
    (_, s1, d1), (_, s2, d2) = results
    assert s2["window_start"] >= s1["window_end"]
    steps1, steps2 = _jsonl(d1 / "telemetry/engine_steps.jsonl"), _jsonl(d2 / "telemetry/engine_steps.jsonl")
    assert steps2[0]["start"] >= steps1[-1]["end"]
    # one engine: step numbers go on, and its prefix cache outlives the first point
    assert steps2[0]["step"] == steps1[-1]["step"] + 1
    assert servers[0].engine is servers[1].engine
    r1, r2 = _jsonl(d1 / "requests.jsonl"), _jsonl(d2 / "requests.jsonl")
    assert min(r["send_time"] for r in r2) >= max(r["end_time"] for r in r1)


def test_the_same_seed_gives_the_same_figures_and_another_cost_other_ones(bench_run, tmp_path):
    base = {p.label: s for p, s, _ in bench_run[0]}
    again = {p.label: s for p, s, _ in _simulate(tmp_path / "again")}
    slow = {p.label: s for p, s, _ in _simulate(tmp_path / "slow", cost=_slow_cost)}
    for label in ("c1", "c2"):
        a, b = base[label], again[label]
        assert b["task_latency_s"]["mean"] == pytest.approx(a["task_latency_s"]["mean"], rel=1e-12)
        assert b["ttft_s"]["mean"] == pytest.approx(a["ttft_s"]["mean"], rel=1e-12)
        assert b["cache"]["prefix_cache_hit_rate"] == pytest.approx(a["cache"]["prefix_cache_hit_rate"], rel=1e-12)
        assert b["requests"]["completed"] == a["requests"]["completed"]
        # three times the step cost: tasks take longer (think time stays what it was)
        assert slow[label]["task_latency_s"]["mean"] > 1.2 * a["task_latency_s"]["mean"]
        assert slow[label]["ttft_s"]["mean"] > 2 * a["ttft_s"]["mean"]


def test_the_clock_never_runs_back_between_load_points_with_a_token_delay(tmp_path):
    (_, _, d1), (_, _, d2) = _simulate(tmp_path / "fe", front_end=FrontEnd(token_s=0.5))
    r1, r2 = _jsonl(d1 / "requests.jsonl"), _jsonl(d2 / "requests.jsonl")
    assert min(r["send_time"] for r in r2) >= max(r["end_time"] for r in r1)


# ---- 6. calibrated set-ups -----------------------------------------------------------------------
MODE = {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "quantization": None, "compile": False,
        "kernel_backend": "cpu", "num_threads": 1}
COEFFICIENTS = {**{t: 0.0 for t in TERMS}, "t_step": 1e-3, "t_seq": 2e-4, "t_dispatch_seq_layer": 1e-5,
                "t_dispatch_expert": 2e-6, "c_weights": 1.5, "c_experts": 2.0, "c_attention": 1.2,
                "c_recurrence": 1.1, "c_head": 1.0}
FIT = {"median_rel_error": 0.05, "p90_rel_error": 0.12, "n_steps": 40, "by_kind": {}}
MEASURED_FE = {"request_s": 0.004, "per_prompt_token_s": 2e-6, "token_s": 0.001, "step_gap_s": 0.0002,
               "source": "measured"}


def calibration(model: str = MODEL, mode: dict | None = None, machine: dict | None = None,
                front_end: dict | None = MEASURED_FE) -> Calibration:
    from flashlane.machine import machine_info

    return Calibration(model, machine or machine_info(), dict(mode or MODE), 2e11, 2e10, "bf16", "bf16",
                       dict(COEFFICIENTS), dict(FIT), {}, 1.0, front_end=front_end)


SHAPE = StepShape(prefill=((100, 0),), decode=(50, 70))


def test_the_simulated_server_scales_step_costs_by_the_measured_served_steps():
    fe = {**MEASURED_FE, "served_prefill_scale": 1.12, "served_decode_scale": 1.05}
    setup, _ = sim_setup.calibrated(MODEL, calibration(front_end=fe), {})
    alone = calibration().cost_model(_cfg()).seconds
    assert setup.cost(SHAPE) == pytest.approx(1.12 * alone(SHAPE), rel=1e-12)
    decode = StepShape(decode=(50, 70))
    assert setup.cost(decode) == pytest.approx(1.05 * alone(decode), rel=1e-12)
    assert setup.assumptions["calibration"]["served_step_scales"] == {
        "prefill": 1.12, "decode": 1.05, "contention_per_seq": {"prefill": 0.0, "decode": 0.0},
        "contention_measured_to_seqs": 1}
    zero, _ = sim_setup.calibrated(MODEL, calibration(front_end=fe), {}, zero_host=True)
    assert zero.front_end.step_scale(True) == 1.0
    # measured with 4 requests at once: each sequence beyond the first adds 5% to a decode step and
    # 2% to a step with a prefill chunk, up to the fourth
    fe = {**fe, "served_decode_contention": 0.05, "served_prefill_contention": 0.02, "served_contention_seqs": 4}
    setup, _ = sim_setup.calibrated(MODEL, calibration(front_end=fe), {})
    assert setup.cost(decode) == pytest.approx(1.05 * 1.05 * alone(decode), rel=1e-12)      # 2 sequences
    six = StepShape(prefill=((100, 0),), decode=(50, 70, 1, 2, 3))
    assert setup.cost(six) == pytest.approx(1.12 * 1.06 * alone(six), rel=1e-12)            # held at 4


def test_the_per_step_error_prices_measured_steps_as_the_simulation_prices_them(tmp_path):
    """compare's per-step error: each measured step against the simulated server's cost (served-step
    scales included), not the engine alone's, so it measures the simulator that ran."""
    import json

    from flashlane.cli.compare_simulation import per_step_error

    fe = {**MEASURED_FE, "served_prefill_scale": 1.25, "served_decode_scale": 1.5}
    setup, _ = sim_setup.calibrated(MODEL, calibration(front_end=fe), {})
    prefill, decode = StepShape(prefill=((100, 0),)), StepShape(decode=(50,))
    (tmp_path / "telemetry").mkdir()
    records = [{"start": 1.0, "end": 1.0 + setup.cost(prefill), "seq_new_tokens": [100], "seq_cached_tokens": [0]},
               {"start": 2.0, "end": 2.0 + 2 * setup.cost(decode), "seq_new_tokens": [1], "seq_cached_tokens": [50]}]
    (tmp_path / "telemetry" / "engine_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    got = per_step_error(calibration(front_end=fe), MODEL, [tmp_path])
    assert got["prefill"]["median_rel_error"] == pytest.approx(0.0, abs=1e-9)
    assert got["decode"]["median_rel_error"] == pytest.approx(0.5, rel=1e-9)       # priced at half the measured
    assert got["all"]["predicted_s"] == pytest.approx(setup.cost(prefill) + setup.cost(decode), rel=1e-9)


def test_a_calibration_in_the_servers_mode_gives_its_costs_and_front_end(tmp_path):
    setup, warnings = sim_setup.calibrated(MODEL, calibration(), {})
    assert warnings == []
    assert setup.engine_args["dtype"] == "bfloat16" and setup.engine_args["num_threads"] == 1
    assert setup.front_end == FrontEnd.from_dict(MEASURED_FE)
    assert setup.cost(SHAPE) == pytest.approx(calibration().cost_model(_cfg()).seconds(SHAPE), rel=1e-12)
    assert setup.cost(SHAPE) > 0
    cal_doc = setup.assumptions["calibration"]
    assert setup.assumptions["step_costs"] == "calibration" and cal_doc["fit"]["n_steps"] == 40
    assert cal_doc["coefficients"] == pytest.approx(COEFFICIENTS)
    assert setup.engine().args.dtype == "bfloat16"
    # from a file: the machine is checked, another CPU is a warning, not an error
    path = tmp_path / "cal.json"
    calibration().save(path)
    from flashlane.machine import machine_info
    _, warnings = sim_setup.calibrated(MODEL, str(path), {"dtype": "bfloat16"}, machine_info())
    assert warnings == []
    _, warnings = sim_setup.calibrated(MODEL, str(path), {}, {**machine_info(), "cpu_model": "Another CPU"})
    assert warnings and "cpu_model" in warnings[0]


def test_a_calibration_of_another_mode_or_model_is_refused_naming_it():
    with pytest.raises(ValueError, match="dtype"):
        sim_setup.calibrated(MODEL, calibration(), {"dtype": "float32"})
    with pytest.raises(ValueError, match="compile"):
        sim_setup.calibrated(MODEL, calibration(), {"compile": True})
    with pytest.raises(ValueError, match="num_threads"):
        sim_setup.calibrated(MODEL, calibration(), {"num_threads": 4})
    with pytest.raises(ValueError, match="quantization"):
        sim_setup.calibrated(MODEL, calibration(), {"quantization": "int8"})
    with pytest.raises(ValueError, match="tiny-standard"):
        sim_setup.calibrated(MODEL, calibration("tiny-standard"), {})
    # the same mode spelt explicitly is fine
    setup, _ = sim_setup.calibrated(MODEL, calibration(), {"dtype": "bfloat16", "compile": False, "num_threads": 1})
    assert setup.engine_args["dtype"] == "bfloat16"


def test_speculative_decoding_needs_a_calibration_with_the_same_drafter_and_states_its_acceptance():
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="speculative"):      # measured without drafts: no draft terms
        sim_setup.calibrated(MODEL, calibration(), {"speculative_config": mtp})
    cal = calibration(mode={**MODE, "speculative": mtp})
    with pytest.raises(ValueError, match="speculative"):      # another draft count
        sim_setup.calibrated(MODEL, cal, {"speculative_config": {**mtp, "num_speculative_tokens": 2}})
    setup, _ = sim_setup.calibrated(MODEL, cal, {"speculative_config": mtp})
    # no acceptance given: InferenceX's 2.99 for 3 drafts, stated as an assumption
    assumed = setup.assumptions["speculative_acceptance"]
    assert assumed["name"] == "acceptance_length" and assumed["value"] == pytest.approx(2.99, abs=1e-3)
    assert setup.engine_args["speculative_config"]["synthetic_acceptance_length"] == pytest.approx(2.99, abs=1e-3)
    assert setup.engine().speculative.synthetic
    given = {**mtp, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 1.5}
    setup, _ = sim_setup.calibrated(MODEL, cal, {"speculative_config": given})
    assert "speculative_acceptance" not in setup.assumptions
    # the same per-draft probability carries 2.99 at k = 3 to other draft counts
    two, row = sim_setup.with_acceptance({"speculative_config": {**mtp, "num_speculative_tokens": 1}})
    assert 1.0 < row["value"] < 2.0 and two["speculative_config"]["synthetic_acceptance_length"] == row["value"]
    # on GPUs too; a hybrid's rollback rows leave room for pages
    hw = sim_setup.on_hardware("glm-5.3-flash", "h200x8", {"speculative_config": mtp, "compile": True})
    assert any(a["name"] == "acceptance_length" for a in hw.assumptions["assumptions"])
    assert hw.engine().plan.num_pages > 0 and hw.engine_args["max_num_seqs"] < sim_setup.GPU_MAX_NUM_SEQS


def test_zero_host_removes_host_terms_and_front_end_time():
    full, _ = sim_setup.calibrated(MODEL, calibration(), {})
    bare, _ = sim_setup.calibrated(MODEL, calibration(), {}, zero_host=True)
    coef = bare.assumptions["calibration"]["coefficients"]
    assert bare.assumptions["calibration"]["zero_host"] is True
    for t in ("t_step", "t_seq", "t_dispatch_seq_layer", "t_dispatch_expert"):
        assert coef[t] == 0
    for t in TERMS:
        if t.startswith("c_"):
            assert coef[t] == pytest.approx(COEFFICIENTS[t])
    assert bare.front_end.admission_s(1000) == 0 and bare.front_end.token_s == 0 and bare.front_end.step_gap_s == 0
    assert 0 < bare.cost(SHAPE) < full.cost(SHAPE)
    # what is left is exactly the op groups' share of the full cost
    model = calibration().cost_model(_cfg())
    host = sum(v for t, v in model.breakdown(SHAPE).items() if not t.startswith("c_"))
    assert bare.cost(SHAPE) == pytest.approx(full.cost(SHAPE) - host, rel=1e-9)


# ---- 7. stack mechanisms -> engine arguments ---------------------------------------------------
def _mech(**kw) -> Mechanisms:
    base = dict(prefix_cache=True, prefix_cache_stateful=False, batching="continuous", static_graphs=False)
    return Mechanisms(**{**base, **kw})


def test_mechanisms_map_to_engine_arguments():
    hybrid, standard = _cfg("tiny-flash"), _cfg("tiny-standard")
    assert sim_setup.is_stateful(hybrid) and not sim_setup.is_stateful(standard)
    assert sim_setup.is_stateful(_cfg("glm-5.3-flash")) and not sim_setup.is_stateful(_cfg("glm-5.3"))
    # a prefix cache that does not restore recurrent state gives a hybrid no hits
    assert sim_setup.mechanism_args(_mech(), hybrid)["enable_prefix_caching"] is False
    assert sim_setup.mechanism_args(_mech(), standard)["enable_prefix_caching"] is True
    assert sim_setup.mechanism_args(_mech(prefix_cache_stateful=True), hybrid)["enable_prefix_caching"] is True
    assert sim_setup.mechanism_args(_mech(prefix_cache=False), standard)["enable_prefix_caching"] is False
    static = sim_setup.mechanism_args(_mech(batching="static", static_batch_size=8), standard)
    assert static["scheduler"] == "static" and static["static_batch_size"] == 8 and static["max_wait_ms"] == 0
    window = sim_setup.mechanism_args(_mech(batching_window_ms=3.5), standard)
    assert window["scheduler"] == "continuous" and window["max_wait_ms"] == pytest.approx(3.5)
    assert sim_setup.mechanism_args(_mech(static_graphs=True), standard)["compile"] is True
    assert sim_setup.mechanism_args(_mech(), standard)["compile"] is False
    # what they map to is a valid simulated engine
    for m in (_mech(batching="static", static_batch_size=8), _mech(batching_window_ms=2.0)):
        SimEngine(hybrid, lambda s: 1.0, **sim_setup.mechanism_args(m, hybrid))


# ---- 8. engine flags <-> engine arguments -----------------------------------------------------
def test_engine_flags_round_trip():
    flags = ["--no-enable-prefix-caching", "--compile", "--compile-sizes", "4,1,2", "--max-wait-ms", "2.5",
             "--scheduler", "static", "--static-batch-size", "8", "--cache-memory", "0.5",
             "--dtype", "float32", "--kv-cache-dtype", "int8", "--num-threads", "3"]
    kw = engine_kwargs_of_flags(flags)
    assert kw["enable_prefix_caching"] is False and kw["compile"] is True
    assert kw["compile_sizes"] == (1, 2, 4) and kw["max_wait_ms"] == pytest.approx(2.5)
    assert kw["cache_memory"] == pytest.approx(0.5) and kw["static_batch_size"] == 8
    back = flags_of_engine_kwargs(kw)
    assert "--no-enable-prefix-caching" in back and "--compile" in back
    assert back[back.index("--compile-sizes") + 1] == "1,2,4"
    assert engine_kwargs_of_flags(back) == kw
    defaults = engine_kwargs_of_flags([])
    assert flags_of_engine_kwargs(defaults) == []
    # bools both ways against their defaults
    assert flags_of_engine_kwargs({"enable_prefix_caching": True, "compile": False}) == []
    assert flags_of_engine_kwargs({"enable_prefix_caching": False}) == ["--no-enable-prefix-caching"]
    assert engine_kwargs_of_flags(["--enable-prefix-caching"])["enable_prefix_caching"] is True
    assert flags_of_engine_kwargs({"compile": True}) == ["--compile"]
    assert flags_of_engine_kwargs({"max_wait_ms": 2.0, "cache_memory": 1 << 30}) == [
        "--cache-memory", str(1 << 30), "--max-wait-ms", "2.0"]


@pytest.mark.parametrize("flags", [["--bogus-flag"], ["--max-wait-ms", "soon"], ["--scheduler", "fifo"],
                                   ["--dtype"], ["--static-batch-size", "0"], ["float32"]])
def test_a_bad_engine_flag_is_a_value_error_naming_where(flags):
    with pytest.raises(ValueError, match=r"^stack 'x' \(hybrid\) flags: "):
        engine_kwargs_of_flags(flags, "stack 'x' (hybrid) flags")


def test_a_client_that_goes_away_frees_its_request_at_once():
    """As flashlane serve does: a stream closed after its first token ends the request in the
    engine; the steps stop instead of running its remaining 50 tokens."""
    async def leave_early(client):
        async with client.stream("POST", "/v1/chat/completions",
                                 json={"messages": MESSAGES, "max_tokens": 50, "stream": True}) as r:
            async for line in r.aiter_lines():
                if (line.startswith("data: ") and line != "data: [DONE]"
                        and json.loads(line[6:])["choices"][0].get("delta", {}).get("content")):
                    break
        await asyncio.sleep(10 * STEP_S)   # time for the engine to have run on, had it kept the request

    server, _ = _serve(leave_early)
    decodes = [s for s in server.steps if s["decode_tokens"]]
    assert len(decodes) <= 2 and not server.engine.has_work and not server.engine.requests
