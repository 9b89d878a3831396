"""`flashlane profile` and the server's live profiling window: named ranges per layer type,
own-time accounting that adds up, Chrome traces that load."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from engine_models import preset
from flashlane.cli.main import main
from flashlane.engine.profiling import StepProfiler, breakdown, per_unit
from flashlane.server.app import create_app
from flashlane.trace_ranges import profiling_enabled, profiling_range
from server_harness import start_engine

ENGINE_ARGS = dict(dtype="float32", cache_memory=32 << 20, max_model_len=256)


def _trace_names(path) -> set[str]:
    events = json.loads(open(path).read())["traceEvents"]
    return {e.get("name") for e in events}


def test_ranges_are_one_shared_no_op_unless_profiling():
    assert not profiling_enabled()
    assert profiling_range("mhc") is profiling_range("kda")
    window = StepProfiler()
    window.start()
    try:
        assert profiling_enabled() and profiling_range("mhc") is not profiling_range("mhc")
    finally:
        window.stop()
    assert not profiling_enabled()


def test_breakdown_charges_own_time_and_top_level_ops_to_the_innermost_range():
    x = torch.randn(8, 8)
    window = StepProfiler()
    window.start()
    try:
        for _ in range(2):
            with profiling_range("engine_step"):
                torch.add(x, 1)
                with profiling_range("mhc"):
                    torch.nn.functional.linear(x, x)     # aten::linear -> t, matmul, mm: one op issued
                    with profiling_range("norm"):
                        x.mul(2).sum()
    finally:
        prof = window.stop()
    events = prof.events()
    b = breakdown(events)
    cats = b["categories"]
    assert b["steps"] == 2
    assert (cats["engine_overhead"]["aten_ops"], cats["mhc"]["aten_ops"], cats["norm"]["aten_ops"]) == (2, 2, 4)
    assert cats["mhc"]["calls"] == cats["norm"]["calls"] == 2 and cats["kda"]["calls"] == 0
    step_us = sum(e.time_range.end - e.time_range.start for e in events if e.name == "engine_step")
    assert b["total_ms"] == pytest.approx(step_us / 1000, rel=1e-9)   # nothing counted twice or lost
    assert all(c["ms"] >= 0 for c in cats.values())
    assert b["between_steps_ms"] >= 0
    assert per_unit(b)["aten_ops"] == 4


def test_profile_cli_breakdown_adds_up_to_the_measured_step(tmp_path, capsys):
    preset("tiny-flash")   # created on first use, outside what is measured
    out = tmp_path / "prof"
    rc = main(["profile", "tiny-flash", "--batch", "2", "--context", "48", "--steps", "3", "--prefill-tokens", "64",
               "--output-dir", str(out), "--dtype", "float32", "--cache-memory", str(32 << 20), "--json"])
    assert rc == 0
    result = json.loads((out / "profile.json").read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert result["machine"]["cpu_capability"] and result["machine"]["torch_threads"] >= 1
    for phase in ("decode", "prefill"):
        p = result[phase]
        assert abs(p["ms"] - p["ms_measured"]) <= 0.1 * p["ms_measured"], phase
        cats = p["categories"]
        assert all(c["ms"] >= 0 for c in cats.values())
        for name in ("kda", "dsa_attention", "indexer", "mhc", "norm", "moe_router", "moe_experts", "lm_head",
                     "sampling", "engine_overhead"):
            assert cats[name]["calls"] > 0 and cats[name]["aten_ops"] > 0, (phase, name)
        assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert result["decode"]["steps"] == 3
    names = _trace_names(result["traces"]["decode"])
    assert {"engine_step", "model_forward", "kda", "mhc", "indexer"} <= names


def test_profile_cli_refuses_a_context_beyond_the_model_length(tmp_path, capsys):
    rc = main(["profile", "tiny-flash", "--context", "300", "--output-dir", str(tmp_path), "--dtype", "float32",
               "--cache-memory", str(32 << 20), "--max-model-len", "256"])
    assert rc == 2
    assert "flashlane profile: error: context 300" in capsys.readouterr().err


def _client(profile_dir=None, transport: str = "process") -> TestClient:
    engine = start_engine(preset("tiny-flash"), transport, **ENGINE_ARGS)
    return TestClient(create_app(engine, "tiny-flash", profile_dir=profile_dir))


def _complete(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "tiny-flash", "prompt": [5, 6, 7, 8, 9], "max_tokens": 4,
                                             "temperature": 0})
    assert r.status_code == 200, r.text


def test_live_window_traces_the_engine_process(tmp_path):
    with _client(str(tmp_path)) as client:
        assert client.post("/stop_profile").status_code == 409
        r = client.post("/start_profile")
        assert r.status_code == 200, r.text
        again = client.post("/start_profile")
        assert again.status_code == 409 and again.json()["error"]["code"] == "profiler_running"
        _complete(client)
        r = client.post("/stop_profile")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["steps"] >= 4
        assert {"engine_step", "model_forward", "kda", "dsa_attention", "mhc", "sampling"} <= _trace_names(body["trace"])
        summary = json.loads(open(body["summary"]).read())
        assert summary["categories"]["kda"]["calls"] > 0
        _complete(client)   # serving goes on after the window


def test_profile_endpoints_are_off_without_profile_dir():
    with _client(transport="thread") as client:   # answered before the engine is asked: no process needed
        for path in ("/start_profile", "/stop_profile"):
            r = client.post(path)
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "profiling_disabled" and "--profile-dir" in r.json()["error"]["message"]
