"""`flashlane compare --stacks`: named serving stacks, role assignment, attribution hooks, and one
end-to-end run against real tiny servers."""

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench_fixtures import run_cli
from flashlane.analyze import Hardware
from flashlane.bench.compare import CompareTarget, assign_roles, launch_command, resolve_targets
from flashlane.bench.layer_profile import breakdown_sentence, layer_shares
from flashlane.bench.machine_load import summarize_load
from flashlane.bench.records import RequestRecord, SessionRecord
from flashlane.bench.stacks import DEFAULT_STACKS, STACKS, parse_stacks
from flashlane.bench.task_components import measured_components, replayed_turns
from flashlane.bench.workloads.agentic import SCALES, generate_trace
from flashlane.cli.compare_attribution import role_of

ROOT = Path(__file__).resolve().parent.parent


def test_stacks_are_real_serve_flags_by_role():
    assert [s.name for s in parse_stacks(None)] == list(DEFAULT_STACKS) == ["naive", "hybrid-cache-gap", "flashlane"]
    assert [s.name for s in parse_stacks("flashlane, naive")] == ["flashlane", "naive"]
    naive = ["--scheduler", "static", "--static-batch-size", "32", "--no-enable-prefix-caching"]
    assert STACKS["naive"].flags("hybrid") == STACKS["naive"].flags("standard") == naive
    gap = STACKS["hybrid-cache-gap"]
    assert gap.flags("hybrid") == ["--no-enable-prefix-caching"] and gap.flags("standard") == ["--enable-prefix-caching"]
    assert "--max-wait-ms" in STACKS["flashlane"].flags("hybrid")
    with pytest.raises(ValueError, match="role"):
        gap.flags("dense")


def test_unknown_or_repeated_stack_is_a_clear_error():
    with pytest.raises(ValueError, match=r"--stacks: unknown stack\(s\) 'fast'; choose from naive"):
        parse_stacks("naive,fast")
    with pytest.raises(ValueError, match="listed twice"):
        parse_stacks("naive,naive")
    r = run_cli(["compare", "--stacks", "naive,turbo", "--no-progress"], timeout=120)
    assert r.returncode == 2 and "flashlane compare: error: --stacks: unknown stack(s) 'turbo'" in r.stderr


def test_url_targets_cannot_take_stacks(fake_server, tmp_path):
    r = run_cli(["compare", fake_server.url, fake_server.url + "/v1", "--stacks", "flashlane",
                 "--scale", "small", "--concurrency", "1", "--num-sessions", "1", "--no-predict",
                 "--output-dir", str(tmp_path / "u"), "--no-progress", "--no-telemetry"])
    assert r.returncode == 0, r.stderr
    assert "URL targets cannot take stacks; only the given servers run" in r.stderr
    assert json.loads((tmp_path / "u" / "compare.json").read_text())["stacks"][0]["name"] == "as given"


def test_roles_from_configs_else_by_position():
    assert (role_of("tiny-flash"), role_of("tiny-standard"), role_of("no-such-model")) == ("hybrid", "standard", None)
    ts = resolve_targets("tiny-standard", "tiny-flash")
    assert assign_roles(ts, role_of) == "from the models' configs"
    assert [t.role for t in ts] == ["standard", "hybrid"]
    ts = resolve_targets("model-x", "model-y")
    assert assign_roles(ts, role_of).startswith("by position")
    assert [t.role for t in ts] == ["hybrid", "standard"]


def test_launch_command_puts_stack_flags_last():
    t = CompareTarget("tiny-flash", "tiny-flash", model="tiny-flash")
    cmd = launch_command(t, 8000, None, ["--seed", "1"], ["--no-enable-prefix-caching"])
    assert cmd[-3:] == ["--seed", "1", "--no-enable-prefix-caching"] and "--model" in cmd
    cmd = launch_command(t, 8000, "{python} srv.py --port {port}", ["--ignored"], ["--max-wait-ms", "2"])
    assert cmd[1:] == ["srv.py", "--port", "8000", "--max-wait-ms", "2"]


def test_long_scale_grows_past_8k_within_the_tiny_presets():
    spec = SCALES["long"]
    assert spec.turns[0] >= 10 and spec.system_tokens > 0 and spec.max_context_tokens < 16384
    tops = []
    for i in range(8):
        reqs = [r for r in generate_trace(spec, 0, i)["requests"] if r.get("type") != "subagent"]
        assert len(reqs) >= 10
        tops.append(max(r["in"] + r["out"] for r in reqs))
    assert min(tops) > 8192 and max(tops) <= spec.max_context_tokens


def _records():
    sess = [SessionRecord("t1", "x", 0, completed=True, start_time=0.0, end_time=10.0, think_time_s=2.0),
            SessionRecord("t2", "x", 0, completed=True, truncated=True, start_time=0.0, end_time=5.0)]
    recs = [RequestRecord("r1", "s1", "t1", send_time=0.0, first_token_time=1.0, last_token_time=3.0,
                          end_time=3.0, input_tokens=100, cached_tokens=0, output_tokens=10),
            RequestRecord("r2", "s1", "t1", send_time=5.0, first_token_time=5.5, last_token_time=8.0,
                          end_time=8.0, input_tokens=300, cached_tokens=96, output_tokens=20),
            RequestRecord("r3", "s2", "t2", send_time=0.0, first_token_time=1.0, end_time=2.0,
                          input_tokens=50, output_tokens=5)]
    return recs, sess


def test_task_components_and_replayed_turns_skip_truncated_tasks():
    recs, sess = _records()
    assert replayed_turns(recs, sess) == [[(100, 0, 10), (300, 96, 20)]]
    m = measured_components(recs, sess)
    assert m["tasks"] == 1 and m["prefill_s"] == pytest.approx(1.5) and m["decode_s"] == pytest.approx(4.5)
    assert m["task_s"] == pytest.approx(10.0) and m["think_s"] == pytest.approx(2.0)


def test_layer_breakdown_from_a_synthetic_profile_json():
    doc = {"batch": 1, "context": 8192, "decode": {"ms": 40.0, "categories": {
        "mhc": {"ms": 18.0, "share": 0.45}, "kda": {"ms": 10.0, "share": 0.25},
        "moe_experts": {"ms": 8.0, "share": 0.2}, "norm": {"ms": 2.0, "share": 0.05},
        "sampling": {"ms": 2.0, "share": 0.05}, "attention": {"ms": 0.0, "share": 0.0}}}}
    assert [n for n, _ in layer_shares(doc)] == ["mhc", "kda", "moe_experts", "norm", "sampling"]
    line = breakdown_sentence("tiny-flash", doc)
    assert line.startswith("At 8.19K context, batch 1, tiny-flash's decode step is 45% mhc, 25% kda, 20% moe_experts")
    assert line.endswith("5% norm, 5% other (`flashlane profile`).")
    listed = {"layer_types": [{"name": "indexer", "time_ms": 30}, {"name": "dsa_attention", "time_ms": 10}]}
    assert layer_shares(listed) == [("indexer", 0.75), ("dsa_attention", 0.25)]
    with pytest.raises(ValueError, match="layer_types"):
        layer_shares({"steps": 3})


def test_machine_load_flags_co_tenants_and_a_saturated_client():
    quiet = summarize_load([(110.0, 100.0, 5.0)] * 4, cores=2)
    assert not quiet["noisy"] and quiet["cotenant_cpu_percent"] == pytest.approx(5.0)
    busy = summarize_load([(190.0, 60.0, 10.0), (200.0, 70.0, 10.0)], cores=2)
    assert busy["noisy"] and busy["cotenant_cpu_percent"] == pytest.approx(120.0)
    assert "other processes used 120% CPU of 200%" in busy["reasons"][0]
    client = summarize_load([(120.0, 20.0, 95.0)], cores=2)
    assert client["noisy"] and "client" in client["reasons"][0]


def _serve_has_static_scheduler() -> bool:
    r = subprocess.run([sys.executable, "-m", "flashlane.cli.main", "serve", "--help"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    return "--scheduler" in r.stdout


@pytest.mark.slow
def test_compare_stacks_end_to_end_against_real_servers(tmp_path):
    stacks = "naive,flashlane" if _serve_has_static_scheduler() else "hybrid-cache-gap,flashlane"
    out = tmp_path / "stacks"
    r = subprocess.run([sys.executable, "-m", "flashlane.cli.main", "compare", "--stacks", stacks,
                        "--scale", "small", "--concurrency", "1", "--num-sessions", "2", "--no-profile",
                        "--calibration-grid", "quick", "--output-dir", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "# flashlane compare — tiny-flash (A) vs tiny-standard (B)"
    assert lines[2].startswith("**Answer:** ") and "tiny-flash" in lines[2]
    assert "Roles: tiny-flash hybrid, tiny-standard standard, from the models' configs." in r.stdout
    res = json.loads((out / "compare.json").read_text())
    names = stacks.split(",")
    assert [s["name"] for s in res["stacks"]] == names and res["tasks_measured"] == 8
    assert [f["stack"] for f in res["findings"]] == names
    assert all(f["ci"] is not None and len(f["hybrid_task_s"]) == 2 for f in res["findings"])
    assert [s["stack"] for s in res["waterfall"]] == names
    # the simulation beside every side used a step-cost calibration of this machine per model
    # (the flashlane stack's static-graph decode in a calibration of that mode of its own)
    assert sorted((c["model"], c["mode"]["compile"]) for c in res["calibrations"].values()) == [
        ("tiny-flash", False), ("tiny-flash", True), ("tiny-standard", False), ("tiny-standard", True)]
    assert len(list((out / "calibrations").glob("*.json"))) == 4
    pids, probe_times = [], set()
    for stack in names:
        for model in ("tiny-flash", "tiny-standard"):
            run = out / stack / model / "c1"
            s = json.loads((run / "summary.json").read_text())
            assert s["errors"]["total"] == 0
            cmd = json.loads((run / "manifest.json").read_text())["server_command"]
            flags = STACKS[stack].flags("hybrid" if model == "tiny-flash" else "standard")
            assert cmd[-len(flags):] == flags
            assert json.loads((run / "machine_load.json").read_text())["n"] >= 0
            pids.append(s["telemetry"].get("server_pid"))
            point = res["points"][f"{stack}/{model}"][0]
            assert point["measured"]["tasks"] == 2
            # the same two tasks simulated beside the measurement, with errors and the per-step error
            sim = point["simulated"]
            measured = sorted(x["tree_id"] for x in map(json.loads, (run / "sessions.jsonl").read_text().splitlines())
                              if x["completed"] and not x["truncated"] and x["phase"] == "profiling")
            assert sorted(sim["task_s_by_tree"]) == measured and len(measured) == 2
            assert all(v > 0 for v in sim["task_s_by_tree"].values())
            fig = sim["figures"]["task_s"]
            assert fig["simulated"] > 0 and fig["error"] == pytest.approx((fig["simulated"] - fig["measured"])
                                                                          / fig["measured"])
            assert sim["per_step"]["all"]["steps"] > 0 and sim["per_step"]["all"]["p90_rel_error"] >= 0
            assert (out / "simulated" / stack / model / "c1" / "round1" / "summary.json").is_file()
            # at the machine's speed on either side of the side's two rounds (schedule positions
            # 0 and 3, or 1 and 2, of 0-4) against its calibration's (one probe per chunk size of
            # the quick grid), and as calibrated beside it
            assert sim["drift"]["probes_now"] == len(sim["probes"]) == (4 if model == "tiny-flash" else 3)
            assert sim["drift"]["probes_then"] == 1
            probe_times |= {(stack, p["at"]) for p in sim["probes"]}
            assert all(sim["drift"][k] > 0 for k in ("compute", "memory", "host"))
            assert sim["figures_as_calibrated"]["task_s"]["measured"] == fig["measured"]
            assert (out / "simulated" / stack / model / "c1" / "as_calibrated" / "round1" / "summary.json").is_file()
            # two interleaved rounds of one task each, in ABBA order, with the engine's own time
            assert [r["round"] for r in point["rounds"]] == [0, 1]
            assert all(r["tasks"] == 1 and r["engine"]["busy_s"] > 0 for r in point["rounds"])
            positions = [r["position"] for r in point["rounds"]]
            assert positions == ([0, 3] if model == "tiny-flash" else [1, 2])
            # the measured attribution tiles the task: its parts sum to the task time within 5%
            part = point["attribution"]
            assert part["forward_s"] > 0 and abs(part["sum_s"] - part["task_s"]) <= 0.05 * part["task_s"]
    assert len(probe_times) == 10 and len({at for _, at in probe_times}) == 10     # 5 a stack, each its own
    assert not any("serving overhead" in x for x in res["explanation"])
    assert [r["stack"] for r in res["simulated_ratios"]] == names and all(r["simulated"] > 0 for r in res["simulated_ratios"])
    assert all(r["simulated_as_calibrated"] > 0 for r in res["simulated_ratios"])
    cf = res["counterfactual"]
    assert cf["steps"][0]["change"].startswith("as measured: ") and cf["steps"][-1]["change"].startswith("+ no host time")
    assert "+ static-graph decode" in [s["change"] for s in cf["steps"]] and cf["not_simulated"] == []
    assert all(s["ratio"] > 0 for s in cf["steps"])
    md = (out / "compare.md").read_text()
    assert "## Simulated beside measured" in md and "task error as calibrated" in md
    assert "simulated as calibrated" in md
    assert all(f["pairs"] and len(f["pairs"]) == 2 and f["engine"] and f["cpu"] for f in res["findings"])
    assert res["conditions"]["tiny-flash"]["dtype"] == res["conditions"]["tiny-standard"]["dtype"]
    assert not res["unequal_conditions"]
    md = (out / "compare.md").read_text()
    assert "Serving conditions: tiny-flash: dtype " in md and "## Where a task's time goes" in md
    html = (out / "report.html").read_text()
    for text in ("Waterfall at concurrency 1", "Per-run reports", f"<li><b>{names[0]}</b>",
                 f"href='{names[0]}/tiny-flash/c1/round0/report.html'"):
        assert text in html
    for pid in filter(None, pids):
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass


def test_profile_summary_is_found_in_the_profile_folder(tmp_path):
    from flashlane.cli.compare_attribution import find_summary, make_profiler
    (tmp_path / "trace_decode.json").write_text(json.dumps({"traceEvents": []}))
    doc = {"decode": {"categories": {"kda": {"ms": 3.0, "share": 1.0}}}}
    (tmp_path / "profile.json").write_text(json.dumps(doc))
    assert find_summary(tmp_path) == doc
    profile = make_profiler(tmp_path / "out", log=lambda m: None)
    if profile is not None:  # `flashlane profile` installed: a model without a config is skipped
        assert profile("not-a-model", 1, 128) is None
