"""`flashlane tune`: studies against real flashlane servers and a fake one, resuming, failed
trials with their reasons, and templating checked before any server starts."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from flashlane.cli.main import main
from flashlane.cli.tune import _recorded_points
from flashlane.tune.objective import parse_slo
from flashlane.tune.report import command_block, render_text
from flashlane.tune.space import flashlane_space, parse_space
from flashlane.tune.study import ratio_ci
from flashlane.tune.target import FlashlaneTarget, TemplateTarget

FAKE = Path(__file__).resolve().parent / "tune_fake_server.py"
# small sessions, one lane, one fresh session per trial: a trial is a server start plus a few requests
QUICK = ["--scale", "small", "--concurrency", "1", "--num-sessions", "1", "--no-telemetry", "--no-progress",
         "--remeasure-top", "0"]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLANE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def unwrapped(text: str) -> str:
    """Shell line continuations undone: a wrapped command back on one line."""
    return re.sub(r" \\\n\s*", " ", text)


def load(db: Path, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{db}")


def test_study_of_real_servers_resumes_and_its_best_meets_the_slo(tmp_path, capsys):
    db, results = tmp_path / "study.db", tmp_path / "results.db"
    args = ["tune", "--model", "tiny-flash", *QUICK, "--storage", f"sqlite:///{db}", "--study-name", "s",
            "--output-dir", str(tmp_path / "out"), "--results-db", str(results),
            "--slo", "p90_task_latency<=120s", "--slo", "ttft_p90<=60s"]
    assert main(args + ["--trials", "4"]) == 0, capsys.readouterr().err
    study = load(db, "s")
    assert len(study.trials) == 4
    assert study.trials[0].user_attrs["default"] and study.trials[0].params["max_num_seqs"] == 64
    for t in study.trials:
        assert t.state == TrialState.COMPLETE, t.user_attrs.get("failure")
        assert t.values[0] > 0 and set(t.constraints) == {"p90_task_latency<=120s", "ttft_p90<=60s"}
        assert t.user_attrs["metrics"]["tasks_per_hour"][0] == t.values[0]
        assert t.user_attrs["command"].startswith("flashlane serve --model tiny-flash --max-num-seqs ")
    first_numbers = [(t.number, t.params) for t in study.trials]

    assert main(args + ["--trials", "6"]) == 0, capsys.readouterr().err
    study = load(db, "s")
    assert len(study.trials) == 6 and [(t.number, t.params) for t in study.trials[:4]] == first_numbers
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "out" / "tune.json").read_text())
    best = next(t for t in study.trials if t.number == result["best"]["trial"])
    p90 = best.user_attrs["metrics"]["p90_task_latency"][0]
    assert p90 <= 120 and all(v <= 0 for v in best.constraints.values())
    assert result["best"]["command"] in unwrapped(out) and "flashlane serve --model tiny-flash" in out
    assert result["importances"] or "importances" in result["importances_note"]
    assert (tmp_path / "out" / "report.html").read_text().count("<img") >= 2

    assert main(["history", "--results-db", str(results)]) == 0
    listed = capsys.readouterr().out
    assert listed.count("| tune ") == 2 and "tiny-flash" in listed


def test_failed_trials_keep_their_reason_and_the_study_goes_on(tmp_path, capsys):
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"knobs": {"mode": {
        "type": "categorical", "choices": ["ok", "slower", "bad-flag", "dies"], "default": "ok",
        "render": {'"ok"': "", '"slower"': "--token-delay 0.003", '"bad-flag"': "--no-such-flag",
                   '"dies"': "--die-after-requests 2"}}}}))
    db = tmp_path / "study.db"
    code = main(["tune", "--serve-command", f"{{python}} {FAKE} --port {{port}} {{mode}}",
                 "--search-space", str(space), "--sampler", "grid", "--trials", "4", "--no-default-trial",
                 *QUICK, "--num-sessions", "3", "--remeasure-top", "2", "--storage", f"sqlite:///{db}",
                 "--study-name", "f",
                 "--output-dir", str(tmp_path / "out"), "--no-record"])
    assert code == 0, capsys.readouterr().err
    by_mode = {t.params["mode"]: t for t in load(db, "f").trials}
    assert by_mode["ok"].state == by_mode["slower"].state == TrialState.COMPLETE
    bad, dies = by_mode["bad-flag"], by_mode["dies"]
    assert bad.state == dies.state == TrialState.FAIL
    assert "before becoming healthy" in bad.user_attrs["failure"]
    assert "unrecognized arguments: --no-such-flag" in bad.user_attrs["log_tail"]
    assert "killed by signal 9 during the trial" in dies.user_attrs["failure"]
    result = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert result["n_failed"] == 2 and result["best"]["trial"] in (by_mode["ok"].number, by_mode["slower"].number)
    # the best two measured again beside the default configuration ("ok", not measured twice)
    again = result["remeasure"]["configs"]
    slower = f"trial-{by_mode['slower'].number}"
    assert list(again) == ["default", slower] and all(len(c["runs"]) == 1 for c in again.values())
    assert again[slower]["ratio_to_default"]["ratio"] > 0
    assert "the default" in capsys.readouterr().out


@pytest.mark.parametrize("template, space, message", [
    ("{python} -c 'open(\"{marker}\", \"w\")' --port {port} {seqs} {nope}", None, "unknown placeholder(s) {nope}"),
    ("{python} -c 'open(\"{marker}\", \"w\")' --port {port}", None, "knob(s) seqs have no placeholder"),
    ("{python} -c 'open(\"{marker}\", \"w\")' --port {port} {seqs}", "{not json", "is not valid JSON"),
    ("{python} -c 'open(\"{marker}\", \"w\")' --port {port} {seqs}",
     '{"knobs": {"seqs": {"type": "int", "low": 8, "high": 1, "default": 4}}}', "low (8) must be below high (1)"),
])
def test_templating_errors_come_before_any_server_starts(tmp_path, capsys, template, space, message):
    marker = tmp_path / "started"
    path = tmp_path / "space.json"
    path.write_text(space or '{"knobs": {"seqs": {"type": "int", "low": 1, "high": 8, "default": 4}}}')
    code = main(["tune", "--serve-command", template.replace("{marker}", str(marker)), "--search-space", str(path),
                 "--trials", "1", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "flashlane tune: error:" in err and message in err, err
    assert not marker.exists() and not (tmp_path / "s.db").exists()


def test_template_and_flags_render_each_knob():
    space = parse_space({"knobs": {
        "max_num_seqs": {"type": "int", "low": 1, "high": 64, "log": True, "default": 64},
        "caching": {"type": "bool", "default": True, "flag": "--enable-prefix-caching",
                    "render": {"true": "--enable-prefix-caching", "false": "--no-enable-prefix-caching"}},
        "share": {"type": "float", "low": 0.01, "high": 0.5, "log": True, "default": 0.1,
                  "when": {"caching": True}, "render": "--checkpoint-share {value}"}}})
    t = TemplateTarget("{python} -m flashlane.cli.main serve --model tiny-flash --port {port} "
                       "--max-num-seqs {max_num_seqs} {caching} {share}", space)
    assert t.command({"max_num_seqs": 8, "caching": False}, 9)[-5:] == [
        "--port", "9", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    assert t.command({"max_num_seqs": 8, "caching": True, "share": 0.123456}, 9)[-3:] == [
        "--enable-prefix-caching", "--checkpoint-share", "0.1235"]
    f = FlashlaneTarget("tiny-flash", space)
    assert f.paste({"max_num_seqs": 8, "caching": False}) == \
        "flashlane serve --model tiny-flash --max-num-seqs 8 --no-enable-prefix-caching"
    with pytest.raises(ValueError, match="conditional knob"):
        TemplateTarget("x --port {port} {max_num_seqs} {caching} {share}",
                       parse_space({"knobs": {**space.to_json()["knobs"],
                                              "share": {"type": "float", "low": 0.01, "high": 0.5, "default": 0.1,
                                                        "when": {"caching": True}}}}))


def test_default_space_follows_the_serve_flags_that_exist():
    full = flashlane_space(cpu_count=4)
    assert full.defaults()["scheduler"] == "continuous" and "static_batch_size" not in full.defaults()
    old = flashlane_space(cpu_count=4, offered={"--max-num-seqs": None, "--max-wait-ms": None,
                                                 "--quantization": ("int8",)})
    assert old.names == ["max_num_seqs", "max_wait_ms", "quantization"]
    assert old.knobs[1].when == {} and old.knobs[2].choices == (None, "int8")


def test_speculative_knob_searches_the_method_and_passes_its_json_to_serve():
    from flashlane.cli.engine_flags import engine_kwargs_of_flags
    from flashlane.cli.tune import has_mtp_layers

    knob = {k.name: k for k in flashlane_space(cpu_count=4).knobs}["speculative"]
    assert knob.default is None and knob.cli_args(None) == []
    assert knob.choices == (None, "ngram:1", "ngram:2", "ngram:3", "ngram:4")     # no MTP layers: n-gram only
    kw = engine_kwargs_of_flags(knob.cli_args("ngram:3"))
    assert kw["speculative_config"]["method"] == "ngram" and kw["speculative_config"]["num_speculative_tokens"] == 3
    mtp = {k.name: k for k in flashlane_space(cpu_count=4, mtp=True).knobs}["speculative"]
    assert {"mtp:1", "mtp:3", "ngram:4"} <= set(mtp.choices)
    kw = engine_kwargs_of_flags(mtp.cli_args("mtp:2"))
    assert kw["speculative_config"]["method"] == "mtp" and kw["speculative_config"]["num_speculative_tokens"] == 2
    assert has_mtp_layers("tiny-flash") and has_mtp_layers("glm-5.3")
    assert not has_mtp_layers("smollm2-135m") and not has_mtp_layers("no-such-model")
    offered = flashlane_space(cpu_count=4, offered={"--max-num-seqs": None, "--speculative-config": None})
    assert offered.names == ["max_num_seqs", "speculative"]
    with pytest.raises(ValueError, match="flag_value"):
        parse_space({"knobs": {"k": {"type": "int", "low": 1, "high": 4, "default": 1, "flag_value": "--k"}}})
    with pytest.raises(ValueError, match=r"flag_value: no argument text for value\(s\) \"b\""):
        parse_space({"knobs": {"k": {"type": "categorical", "choices": [None, "a", "b"], "default": None,
                                     "flag_value": {"\"a\"": "x"}}}})
    with pytest.raises(ValueError, match="fits only categorical"):
        parse_space({"knobs": {"k": {"type": "int", "low": 1, "high": 4, "default": 1, "flag_value": {"1": "x"}}}})


def test_slo_parsing_and_improvement_ci():
    s = parse_slo("ttft_p90<=500ms")
    assert (s.metric, s.op, s.bound) == ("ttft_p90", "<=", 0.5) and s.violation(0.25) < 0 < s.violation(1.0)
    for bad in ("ttft_p90<2s", "nope<=1s", "tasks_per_hour>=3s"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    r = ratio_ci([(200.0, 180.0, 220.0)], [(100.0, 90.0, 110.0)])
    assert r["low"] < 2.0 < r["high"] and abs(r["ratio"] - 2.0) < 1e-9
    assert ratio_ci([(200.0, None, None)], [(100.0, 90.0, 110.0)])["low"] is None


def test_ctrl_c_stops_the_server_and_leaves_a_resumable_study(tmp_path):
    import signal
    import subprocess
    import time

    import psutil

    space = tmp_path / "space.json"
    space.write_text(json.dumps({"knobs": {"delay": {"type": "categorical", "choices": [0.02], "default": 0.02}}}))
    db = tmp_path / "study.db"
    cmd = [sys.executable, "-m", "flashlane.cli.main", "tune", "--serve-command",
           f"{{python}} {FAKE} --port {{port}} --token-delay {{delay}}", "--search-space", str(space),
           "--trials", "1", *QUICK, "--num-sessions", "200", "--duration", "20", "--storage", f"sqlite:///{db}",
           "--study-name", "i", "--output-dir", str(tmp_path / "out"), "--no-record"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, children = time.monotonic() + 120, []
        log = tmp_path / "out" / "trials" / "trial-0000" / "server.log"
        while time.monotonic() < deadline and proc.poll() is None and not (log.exists() and children):
            children = psutil.Process(proc.pid).children(recursive=True)
            time.sleep(0.1)
        time.sleep(3.0)  # the server starts, the 20 s measurement begins: Ctrl-C lands inside the trial
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "the study resumes with the same command" in err, err
    def alive():
        return [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

    wait_until = time.monotonic() + 15  # the init process may take a moment to reap them
    while alive() and time.monotonic() < wait_until:
        time.sleep(0.1)
    assert children and not alive()
    (t,) = load(db, "i").trials
    assert t.state == TrialState.FAIL and t.user_attrs["interrupted"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    trials = load(db, "i").trials
    assert len(trials) == 2 and trials[1].state == TrialState.COMPLETE


LONG_COMMAND = ("flashlane serve --model tiny-flash --max-num-seqs 64 --max-num-batched-tokens 2048 --scheduler "
                "continuous --max-wait-ms 0 --page-size 16 --enable-prefix-caching --checkpoint-share 0.1 "
                "--served-model-name 'a b' --tokenizer \"$HOME/tok\" && echo done")


def test_the_printed_serve_command_wraps_and_pastes_back_unchanged():
    block = command_block(LONG_COMMAND, indent="    ")
    lines = block.splitlines()
    assert len(lines) > 1 and all(len(line) <= 88 for line in lines)
    assert all(line.endswith(" \\") for line in lines[:-1])
    assert "--max-wait-ms 0" in block and "'a b'" in block   # a flag stays beside its value, quoting kept
    assert '"$HOME/tok"' in block and " && echo done" in block   # nothing re-quoted
    assert shlex.split(unwrapped(block)) == shlex.split(LONG_COMMAND)
    metrics = {"tasks_per_hour": [6000.0, 5000.0, 7000.0]}
    text = render_text({"study": "s", "objective": "maximize tasks_per_hour", "n_trials": 3, "n_failed": 0,
                        "metrics": ["tasks_per_hour"], "slos": [], "pareto_front": [], "importances": {},
                        "importances_note": None, "remeasure": None, "default_params": {},
                        "best": {"trial": 2, "params": {"max_num_seqs": 64}, "metrics": metrics,
                                 "command": LONG_COMMAND}})
    assert all(len(line) <= 88 for line in text.splitlines()[2:]) and LONG_COMMAND in unwrapped(text)


def test_recorded_configurations_are_named_by_trial_never_best(tmp_path):
    """The shape of benchmarks/results/tune_tiny_flash_small.json: the search's best is the default
    (trial 0), so the re-measured other trial (6) is worse, and must not be recorded as "best"."""
    runs = lambda name: [{"run_dir": str(tmp_path / f"r{k}-{name}"), "metrics": {}} for k in (1, 2)]  # noqa: E731
    result = {"remeasure": {"metric": "tasks_per_hour", "configs": {"default": {"runs": runs("default")},
                                                                    "trial-6": {"runs": runs("trial-6")}}},
              "best": {"trial": 0}, "trials": [{"number": 0, "run_dir": str(tmp_path / "t0")}]}
    assert [name for name, _ in _recorded_points(result)] == ["default", "default-r2", "trial-6", "trial-6-r2"]
    assert _recorded_points({**result, "remeasure": None}) == [("trial-0", tmp_path / "t0")]
