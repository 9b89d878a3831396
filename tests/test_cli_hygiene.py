"""The `flashlane` command line as a new user meets it (issue 13, items 4 and 10): API keys,
busy ports, bench defaults and messages, usage on a misspelt flag, help with defaults, the
analyze table. Loopback only; the one real server is started once."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from flashlane.cli.main import build_parser, main
from server_harness import free_port, stop_with_sigint, wait_healthy

API_KEY_ENV = "FLASHLANE_API_KEY"

REPO = Path(__file__).resolve().parent.parent


def _flashlane(args, cwd, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "flashlane.cli.main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


# ---- item 4: API key ------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["", "   "])
def test_serve_refuses_an_empty_api_key_flag(capsys, monkeypatch, key):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    # checked before the model is loaded: a model that does not exist is never looked at
    assert main(["serve", "--model", "no-such-model", "--api-key", key]) == 2
    err = capsys.readouterr().err
    assert "--api-key is empty" in err and "authentication off" in err
    assert "no-such-model" not in err


def test_serve_refuses_an_empty_api_key_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "")
    assert main(["serve", "--model", "no-such-model"]) == 2
    assert f"{API_KEY_ENV} is empty" in capsys.readouterr().err


def test_api_key_sources_and_the_key_is_never_in_a_message():
    from flashlane.cli.serve import resolve_api_key

    assert resolve_api_key(None, {}) is None
    assert resolve_api_key(None, {API_KEY_ENV: "from-env"}) == "from-env"
    assert resolve_api_key("from-flag", {API_KEY_ENV: "from-env"}) == "from-flag"
    with pytest.raises(ValueError) as exc:
        resolve_api_key(" s3cret ", {})
    assert "whitespace" in str(exc.value) and "s3cret" not in str(exc.value)


def test_servers_compare_starts_do_not_inherit_the_key(monkeypatch, tmp_path):
    """compare's bench sends no key: an exported FLASHLANE_API_KEY must not lock it out."""
    from flashlane.bench.server_launch import ServerProcess, ServerStartError

    monkeypatch.setenv(API_KEY_ENV, "exported")
    probe = [sys.executable, "-c", f"import os, sys; sys.exit(7 if {API_KEY_ENV!r} in os.environ else 5)"]
    with pytest.raises(ServerStartError, match="code 5"):
        ServerProcess(probe, "http://127.0.0.1:9", tmp_path / "log", startup_timeout_s=60).start()


# ---- item 10: serve on a busy port ------------------------------------------------------------

def test_serve_on_a_busy_port_fails_before_loading_or_announcing(capsys, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "no-such-model", "--host", "127.0.0.1", "--port", str(port)]) == 2
    out = capsys.readouterr()
    assert f"port {port} is in use" in out.err
    assert "serving" not in out.out and "no-such-model" not in out.err  # the model was never loaded


@pytest.mark.slow
def test_serve_reads_the_key_from_the_environment_and_a_second_server_on_its_port_fails(tmp_path):
    port = free_port()
    env = {**os.environ, API_KEY_ENV: "env-k3y-value", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "flashlane.cli.main", "serve", "--model", "tiny-flash", "--port", str(port),
           "--dtype", "float32", "--cache-memory", str(32 << 20), "--max-model-len", "256", "--shutdown-timeout", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url)
        assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
        ok = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer env-k3y-value"}, timeout=30)
        assert ok.status_code == 200
        second = _flashlane(["serve", "--model", "tiny-flash", "--port", str(port)], tmp_path,
                            {API_KEY_ENV: "other"}, timeout=120)
        assert second.returncode == 2 and f"port {port} is in use" in second.stderr
        assert "serving" not in second.stdout
    finally:
        out = stop_with_sigint(proc)
    assert proc.returncode == 0, out
    assert "serving tiny-flash" in out and "API key required" in out
    assert "env-k3y-value" not in out  # never printed, not even at start-up


# ---- item 10: bench -------------------------------------------------------------------------

def test_bench_without_output_dir_writes_a_timestamped_folder_and_counts_requests(fake_server, tmp_path):
    base = ["bench", "--base-url", fake_server.url, "--workload", "fixed", "--input-len", "8", "--output-len", "2",
            "--no-progress", "--no-telemetry", "--warmup", "none"]
    r = _flashlane(base + ["--num-requests", "3"], tmp_path)
    assert r.returncode == 0, r.stderr
    (folder,) = [p for p in tmp_path.iterdir() if p.name.startswith("flashlane-bench-")]
    assert re.fullmatch(r"flashlane-bench-\d{8}-\d{6}", folder.name)
    assert f"results: {folder.name}" in r.stdout
    assert json.loads((folder / "summary.json").read_text())["requests"]["completed"] == 3
    out = tmp_path / "alias"
    r = _flashlane(base + ["--num-prompts", "2", "--output-dir", str(out)], tmp_path)  # vLLM's spelling
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "summary.json").read_text())["requests"]["completed"] == 2


def test_bench_request_and_session_counts_are_not_mixed_up(capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--workload", "fixed", "--num-sessions", "3"]) == 2
    assert "--num-requests" in capsys.readouterr().err
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--workload", "multiturn", "--num-requests", "3"]) == 2
    assert "--num-sessions" in capsys.readouterr().err


def test_bench_base_url_needs_a_scheme(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--base-url", "127.0.0.1:8000"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "base URL must start with http:// or https://" in err and err.startswith("usage: flashlane bench")
    from flashlane.bench.runner import BenchConfig
    with pytest.raises(ValueError, match="base URL must start with http:// or https://"):
        BenchConfig(base_url="localhost:8000", output_dir="unused", concurrency=[1])


def test_an_aborted_run_does_not_report_no_errors(tmp_path):
    r = _flashlane(["bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m", "--scale", "small",
                    "--num-sessions", "1", "--output-dir", str(tmp_path / "a"), "--no-progress"], tmp_path)
    assert r.returncode == 1 and "aborted" in r.stderr
    report = (tmp_path / "a" / "report.md").read_text()
    assert "run aborted" in report
    row = next(line for line in report.splitlines() if line.startswith("| errors by class"))
    assert "none" not in row and "aborted" in row


# ---- item 10: usage and help ----------------------------------------------------------------

def test_a_misspelt_flag_prints_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--base-url", "http://127.0.0.1:9", "--concurency", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: flashlane bench")
    assert "unrecognized arguments: --concurency 2" in err and "did you mean --concurrency?" in err


def _subparsers():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [("flashlane", parser)] + sorted(sub.choices.items())


def test_every_flag_has_help_that_shows_its_default():
    missing = []
    for name, p in _subparsers():
        fmt = p.formatter_class(prog=p.prog)
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            text = fmt._get_help_string(action) if action.help else ""
            flag = "/".join(action.option_strings) or action.dest
            if not action.help:
                missing.append(f"{name} {flag}: no help")
            elif not action.required and "default" not in text.lower():
                missing.append(f"{name} {flag}: no default shown")
    assert not missing, "\n".join(missing)
    assert "(default: 8000)" in " ".join(dict(_subparsers())["serve"].format_help().split())


# ---- item 10: analyze table -----------------------------------------------------------------

def test_analyze_table_columns_align_and_the_ratio_is_explained_on_top():
    from flashlane.analyze import Options, Setup, build_report, get_hardware, load_task, render_text, resolve_model

    models = [resolve_model("glm-5.3-flash"), resolve_model("glm-5.3")]
    text = render_text(build_report(models, Setup(get_hardware("h200")), load_task("agentic"),
                                    Options((8 * 1024, 128 * 1024, 1024 ** 2), 32)))
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.rstrip().endswith("baseline/model"))
    top = "\n".join(lines[:head])
    assert "baseline / model = glm-5.3 / glm-5.3-flash" in top
    assert "above 1x favours glm-5.3-flash" in top and "above 1x favours glm-5.3" in top
    end = next(i for i, line in enumerate(lines) if line.startswith("=="))
    rows = [line for line in lines[head:end] if line.strip() and not line.startswith(("--", "("))]
    assert len(rows) > 60
    ends = set()
    for line in rows:
        line = re.sub(r"   (\(does not fit|B=).*$", "", line).rstrip().removesuffix(" ^")
        ends.add(len(line) if line.split()[-1] not in ("glm5_next", "glm_moe_dsa") else None)
    ends.discard(None)
    assert len(ends) == 1, f"ratio column ends at {sorted(ends)}"
    rate_row = next(line for line in rows if line.startswith("decode tok/s B=1 @8k"))
    assert rate_row.rstrip().endswith("^")  # a rate: read the other way
