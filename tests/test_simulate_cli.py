"""`flashlane simulate` and `flashlane compare --simulate` command lines, in process (as the
calibrate and analyze CLI tests run them): a calibrated tiny preset, a stack's flags, a full-size
model on named GPUs, the whole simulated study, and every refusal naming its problem (exit 2)."""

from __future__ import annotations

import json

import pytest

from flashlane.analyze.calibration import Calibration
from flashlane.analyze.step_cost import TERMS
from flashlane.cli.compare_study import SENSITIVITY
from flashlane.cli.main import main
from flashlane.machine import machine_info

MODE = {"dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "quantization": None, "compile": False,
        "kernel_backend": "cpu", "num_threads": 1}
COEFFICIENTS = {**{t: 0.0 for t in TERMS}, "t_step": 1e-3, "t_seq": 1e-4, "c_weights": 1.0, "c_attention": 1.0,
                "c_experts": 1.0, "c_recurrence": 1.0, "c_head": 1.0}
SMALL = ["--scale", "small", "--no-progress"]


@pytest.fixture(scope="module")
def cal_file(tmp_path_factory):
    """A hand-built calibration of tiny-flash on this machine (nothing measured)."""
    path = tmp_path_factory.mktemp("cal") / "tiny-flash.json"
    Calibration("tiny-flash", machine_info(), dict(MODE), 1e11, 1e10, "bf16", "bf16", dict(COEFFICIENTS),
                {"median_rel_error": 0.1, "p90_rel_error": 0.2, "n_steps": 50, "by_kind": {}}, {}, 1.0).save(path)
    return path


def _cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _manifest(folder) -> dict:
    return json.loads((folder / "manifest.json").read_text())


# ---- flashlane simulate ----------------------------------------------------------------------
def test_simulate_with_a_calibration_writes_a_bench_run(cal_file, tmp_path, capsys):
    out = tmp_path / "run"
    rc, stdout, stderr = _cli(capsys, ["simulate", "tiny-flash", "--calibration", str(cal_file), *SMALL,
                                       "--concurrency", "1", "--num-sessions", "2", "--no-record",
                                       "--output-dir", str(out)])
    assert rc == 0, stderr
    assert "| load | tasks/h |" in stdout and "| c1 |" in stdout and str(out) in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task_latency_s"]["n"] == 2 and summary["task_latency_s"]["mean"] > 0
    assert summary["requests"]["completed"] > 0 and summary["requests"].get("failed", 0) == 0
    manifest = _manifest(out)
    sim = manifest["simulation"]
    assert manifest["clock"] == "simulated seconds (virtual time)"
    assert sim["step_costs"] == "calibration" and sim["calibration"]["file"] == str(cal_file)
    assert sim["engine_args"]["dtype"] == "bfloat16" and sim["engine_args"]["num_threads"] == 1
    assert sim["prompt_tokens"] == "tiny-flash's tokenizer" and manifest["tokenizer_exact"] is True
    assert (out / "telemetry" / "engine_steps.jsonl").is_file()
    assert "server flags: --dtype bfloat16 --num-threads 1" in stderr


def test_simulate_runs_a_stacks_flags(cal_file, tmp_path, capsys):
    out = tmp_path / "naive"
    rc, _, stderr = _cli(capsys, ["simulate", "tiny-flash", "--calibration", str(cal_file), "--stack", "naive",
                                  *SMALL, "--concurrency", "1", "--num-sessions", "2", "--no-record",
                                  "--output-dir", str(out)])
    assert rc == 0, stderr
    args = _manifest(out)["simulation"]["engine_args"]
    assert args["scheduler"] == "static" and args["enable_prefix_caching"] is False
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cache"]["cached_tokens"] == 0     # no prefix cache: nothing reused
    assert "--scheduler static" in stderr and "--no-enable-prefix-caching" in stderr


@pytest.mark.parametrize("extra, named", [
    (["--serve-arg=--dtype", "--serve-arg=float32"], ["dtype", "float32", "bfloat16"]),
    (["--serve-arg=--compile"], ["compile"]),
    (["--tp", "2"], ["--tp"]),
    (["--stack", "nope"], ["--stack", "nope"]),
    (["--mode", "live"], ["mode", "recorded"]),
    (["--serve-arg=--no-such-flag"], ["--serve-arg", "--no-such-flag"]),
])
def test_simulate_refuses_a_mismatch_naming_it(cal_file, tmp_path, capsys, extra, named):
    out = tmp_path / "never"
    rc, stdout, stderr = _cli(capsys, ["simulate", "tiny-flash", "--calibration", str(cal_file), *SMALL,
                                       "--num-sessions", "1", "--no-record", "--output-dir", str(out), *extra])
    assert rc == 2
    assert "simulate: error:" in stderr and all(n in stderr for n in named), stderr
    assert not (out / "summary.json").exists() and "| c1 |" not in stdout


def test_simulate_refuses_a_calibration_of_a_newer_schema(cal_file, tmp_path, capsys):
    raw = json.loads(cal_file.read_text())
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps({**raw, "schema": 99}))
    rc, _, stderr = _cli(capsys, ["simulate", "tiny-flash", "--calibration", str(newer), *SMALL,
                                  "--num-sessions", "1", "--no-record", "--output-dir", str(tmp_path / "x")])
    assert rc == 2 and "schema 99" in stderr
    other = tmp_path / "standard.json"
    other.write_text(json.dumps({**raw, "model": "tiny-standard"}))
    rc, _, stderr = _cli(capsys, ["simulate", "tiny-flash", "--calibration", str(other), *SMALL,
                                  "--num-sessions", "1", "--no-record", "--output-dir", str(tmp_path / "y")])
    assert rc == 2 and "tiny-standard" in stderr


def test_simulate_a_full_size_model_on_named_gpus(tmp_path, capsys):
    out = tmp_path / "h200"
    rc, stdout, stderr = _cli(capsys, ["simulate", "glm-5.3-flash", "--hardware", "h200x8", *SMALL,
                                       "--num-sessions", "1", "--no-record", "--output-dir", str(out)])
    assert rc == 0, stderr
    assert "| c1 |" in stdout
    manifest = _manifest(out)
    sim = manifest["simulation"]
    assert sim["step_costs"] == "hardware" and sim["hardware"] == "h200x8"
    assert sim["layout"] == {"devices": 8, "tp": 8, "ep": 8} and sim["weight_dtype"] == "fp8"
    assert manifest["clock"] == "simulated seconds (virtual time)"
    assert json.loads((out / "summary.json").read_text())["task_latency_s"]["mean"] > 0


@pytest.mark.parametrize("extra, named", [
    (["--hardware", "h999x8"], ["--hardware", "h999x8"]),
    (["--hardware", "h200x8", "--ep", "3"], ["ep", "3"]),
])
def test_simulate_refuses_unknown_hardware_or_layout(tmp_path, capsys, extra, named):
    rc, _, stderr = _cli(capsys, ["simulate", "glm-5.3-flash", *extra, *SMALL, "--num-sessions", "1",
                                  "--no-record", "--output-dir", str(tmp_path / "never")])
    assert rc == 2 and "simulate: error:" in stderr and all(n in stderr for n in named), stderr
    assert not (tmp_path / "never" / "summary.json").exists()


# ---- flashlane compare --simulate ---------------------------------------------------------------
def test_compare_simulate_runs_the_study_with_assumptions_and_sensitivity(tmp_path, capsys):
    out = tmp_path / "study"
    rc, stdout, stderr = _cli(capsys, ["compare", "glm-5.3-flash", "glm-5.3", "--simulate", "--hardware", "h200x8",
                                       *SMALL, "--num-sessions", "1", "--output-dir", str(out)])
    assert rc == 0, stderr
    md = (out / "compare.md").read_text()
    assert md in stdout
    assert "| **public finding** (seed) | 14.4 / 6.8 |" in md
    assert any(line.startswith("**Answer:** In simulation") for line in md.splitlines())
    assert any(line.startswith("**Sensitivity**") for line in md.splitlines())
    assert "\n## Assumptions\n" in md and "- layout: 8 GPUs, tp 8, ep 8" in md
    for stack in ("naive", "hybrid-cache-gap", "flashlane"):
        assert f"| {stack} (simulated) |" in md

    doc = json.loads((out / "compare.json").read_text())
    assert doc["models"] == {"hybrid": "glm-5.3-flash", "standard": "glm-5.3"} and doc["hardware"] == "h200x8"
    assert list(doc["stacks"]) == ["naive", "hybrid-cache-gap", "flashlane"]
    for name, row in doc["stacks"].items():
        assert row["ratio"] > 0, name
        assert row["hybrid"]["task_s"] > 0 and row["standard"]["task_s"] > 0
        assert row["ratio"] == pytest.approx(row["hybrid"]["task_s"] / row["standard"]["task_s"], rel=1e-6)
    # the stacks' mechanisms reached the engines: naive is static without a prefix cache, the
    # hybrid-cache-gap stack has none for the hybrid only
    assert doc["engine_args"]["naive"]["hybrid"] == {"scheduler": "static", "enable_prefix_caching": False}
    assert doc["engine_args"]["hybrid-cache-gap"]["hybrid"]["enable_prefix_caching"] is False
    gap = doc["stacks"]["hybrid-cache-gap"]
    assert gap["hybrid"]["prefix_hit"] == 0 and gap["standard"]["prefix_hit"] > 0
    assert doc["stacks"]["naive"]["standard"]["prefix_hit"] == 0

    sens = doc["sensitivity"]
    assert sens["stack"] in doc["stacks"] and sens["base_ratio"] > 0
    assert sorted(a["assumption"] for a in sens["assumptions"]) == sorted(SENSITIVITY) and len(SENSITIVITY) == 5
    for a in sens["assumptions"]:
        assert set(a["ratios"]) == {"x0.5", "x2"} and all(v > 0 for v in a["ratios"].values()), a
        assert a["swing"] == pytest.approx(max(a["ratios"].values()) - min(a["ratios"].values()), abs=1e-12)
    swings = [a["swing"] for a in sens["assumptions"]]
    assert swings == sorted(swings, reverse=True)
    assert doc["layout"] == {"devices": 8, "tp": 8, "ep": 8}
    assert doc["workload"]["tasks_per_side"] == 1 and doc["workload"]["scale"] == "small"


@pytest.mark.parametrize("argv, named", [
    (["glm-5.3-flash", "glm-5.3", "--simulate"], ["--hardware"]),
    (["glm-5.3-flash", "glm-5.3", "--hardware", "h200x8"], ["--simulate"]),
    (["tiny-flash", "tiny-flash", "--simulate", "--hardware", "h200x8"], ["same target"]),
    (["glm-5.3", "tiny-standard", "--simulate", "--hardware", "h200x8"], ["one hybrid", "one standard"]),
    (["glm-5.3-flash", "glm-5.3", "--simulate", "--hardware", "h200x8", "--concurrency", "1,2"],
     ["one load point", "--concurrency"]),
])
def test_compare_simulate_refuses_what_it_cannot_study(tmp_path, capsys, argv, named):
    out = tmp_path / "never"
    rc, _, stderr = _cli(capsys, ["compare", *argv, *SMALL, "--num-sessions", "1", "--output-dir", str(out)])
    assert rc == 2 and "error" in stderr and all(n in stderr for n in named), stderr
    assert not (out / "compare.json").exists()


def test_compare_calibration_grid_reaches_the_concurrency_it_simulates():
    from flashlane.cli.compare_simulation import CALIBRATION_GRIDS, grid_args

    assert grid_args("compare") == CALIBRATION_GRIDS["compare"]          # concurrency 1: the grid as it is
    assert grid_args("compare", 4) == CALIBRATION_GRIDS["compare"]
    wide = grid_args("compare", 8)
    assert wide[wide.index("--batches") + 1] == "1,4,8" and CALIBRATION_GRIDS["compare"][3] == "1,4"
    assert grid_args("quick", 8) == ["--quick"]


def test_calibration_batches_are_capped_in_prompt_tokens():
    from flashlane.cli.calibrate import batch_contexts

    assert batch_contexts((512, 2048, 8192), 1, 16384, 10**6) == [512, 2048, 8192]
    assert batch_contexts((512, 2048, 8192), 4, 16384, 10**6) == [512, 2048, 4096]
    assert batch_contexts((512, 2048, 8192), 8, 16384, 10**6) == [512, 2048]
    assert batch_contexts((512, 2048, 8192), 64, 16384, 10**6) == [512]        # never below the smallest
    assert batch_contexts((512, 2048, 8192), 8, None, 3000) == [512, 2048, 3000]  # the model's longest
    assert batch_contexts((512, 2048), 8, 16384, 300) == [300]


def test_calibrate_refuses_a_batch_token_cap_below_one(capsys):
    rc, _, stderr = _cli(capsys, ["calibrate", "tiny-flash", "--batch-tokens", "0"])
    assert rc == 2 and "--batch-tokens" in stderr


def test_a_speculative_stack_gets_no_simulated_figures_and_no_counterfactual(tmp_path):
    """The simulator does not model speculative decoding: compare says so and simulates nothing
    for such a stack (no calibration is started), nor builds its waterfall from one."""
    from types import SimpleNamespace

    from flashlane.cli.compare_simulation import LocalSimulator

    logs: list[str] = []
    sim = LocalSimulator([], tmp_path, log=logs.append, cache_dir=tmp_path / "cal")
    spec = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    hyb = SimpleNamespace(name="tiny-flash", model="tiny-flash", role="hybrid")
    std = SimpleNamespace(name="tiny-standard", model="tiny-standard", role="standard")
    group = SimpleNamespace(name="flashlane-spec", flags={hyb.name: spec, std.name: spec},
                            stack=SimpleNamespace(external=lambda role: False),
                            points={hyb.name: [SimpleNamespace(latencies=[2.0])],
                                    std.name: [SimpleNamespace(latencies=[1.0])]})
    assert sim.beside(group, hyb, run=None, cfg=None, source=None, synth=None, folder=tmp_path) is None
    assert any("decodes speculatively" in line and "flashlane-spec" in line for line in logs)
    assert sim.counterfactuals([group], [hyb, std], None, None, tmp_path) is None
    assert not (tmp_path / "cal").exists()          # nothing was calibrated


def _waterfall(tmp_path, monkeypatch, calibrated_modes):
    """The counterfactual waterfall from the naive stack, with the simulator's runs replaced by a
    fixed task time per engine mode (the hybrid 2x slower without its prefix cache, static graphs
    10% faster, no host time 10% faster) and calibrations only for ``calibrated_modes``."""
    from types import SimpleNamespace

    import flashlane.cli.compare_simulation as cs
    from flashlane.bench.stacks import STACKS

    sim = cs.LocalSimulator([], tmp_path, log=lambda line: None, cache_dir=tmp_path / "cal")

    def setup(model, args, zero_host=False):
        return (model, dict(args), zero_host) if bool(args.get("compile")) in calibrated_modes else None

    def replay(server, cfg, source, synth, point, controls, folder):
        model, args, zero_host = server
        t = 2.0 if model == "tiny-flash" and not args.get("enable_prefix_caching") else 1.0
        t *= (0.9 if args.get("compile") else 1.0) * (0.9 if zero_host else 1.0)
        return None, {"task0": t, "task1": t}

    monkeypatch.setattr(sim, "setup", setup)
    monkeypatch.setattr(cs, "SimulatedServer", lambda s: s)
    monkeypatch.setattr(cs, "replay_rounds", replay)
    monkeypatch.setattr(cs, "round_controls", lambda dirs: None)
    monkeypatch.setattr(cs, "_sim_cfg", lambda cfg: cfg)
    hyb = SimpleNamespace(name="tiny-flash", model="tiny-flash", role="hybrid")
    std = SimpleNamespace(name="tiny-standard", model="tiny-standard", role="standard")
    naive = STACKS["naive"]
    point = SimpleNamespace(label="c1")
    run = SimpleNamespace(latencies=[2.0], rounds=[], point=point)
    group = SimpleNamespace(name="naive", stack=naive, cfgs={hyb.name: None, std.name: None},
                            flags={hyb.name: naive.flags("hybrid"), std.name: naive.flags("standard")},
                            points={hyb.name: [run], std.name: [SimpleNamespace(latencies=[1.0], rounds=[], point=point)]})
    return sim.counterfactuals([group], [hyb, std], None, None, tmp_path)


def test_the_waterfall_adds_static_graph_decode_from_a_calibration_in_that_mode(tmp_path, monkeypatch):
    cf = _waterfall(tmp_path, monkeypatch, calibrated_modes={False, True})
    assert [s["change"] for s in cf["steps"]] == [
        "as measured: naive", "+ prefix caching for the hybrid (state checkpoints)",
        "+ continuous batching, 2 ms window", "+ static-graph decode",
        "+ no host time (front end, per-step and dispatch terms zero)"]
    assert [s["ratio"] for s in cf["steps"]] == pytest.approx([2.0, 1.0, 1.0, 1.0, 1.0])
    assert [s["hybrid_task_s"] for s in cf["steps"]] == pytest.approx([2.0, 1.0, 1.0, 0.9, 0.81])
    assert cf["not_simulated"] == []


def test_the_waterfall_names_a_mechanism_without_a_calibration_and_goes_on(tmp_path, monkeypatch):
    cf = _waterfall(tmp_path, monkeypatch, calibrated_modes={False})
    assert [s["change"] for s in cf["steps"]][-2:] == [
        "+ continuous batching, 2 ms window", "+ no host time (front end, per-step and dispatch terms zero)"]
    assert cf["steps"][-1]["hybrid_task_s"] == pytest.approx(0.9)      # eager steps, host time off
    assert cf["not_simulated"] == ["static-graph decode: no calibration of this machine in that mode"]
    assert _waterfall(tmp_path, monkeypatch, calibrated_modes={True}) is None     # not even as measured
