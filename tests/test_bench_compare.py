"""`flashlane compare`: servers started and stopped by compare, side-by-side table, report."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench_fixtures import run_cli

FAKE_SERVE = f"{sys.executable} tests/bench_fake_server.py --port {{port}} --model {{model}} --token-delay 0.002"


def server_pids(out: Path) -> list[int]:
    pids = set()
    for f in list(out.glob("*/c*/summary.json")) + list(out.glob("*/*/c*/summary.json")):  # plain, stacks
        pid = json.loads(f.read_text())["telemetry"].get("server_pid")
        if pid:
            pids.add(pid)
    return sorted(pids)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_compare_starts_two_servers_and_prints_the_table(tmp_path):
    out = tmp_path / "cmp"
    r = run_cli(["compare", "slow-model", "fast-model", "--scale", "small", "--concurrency", "1,2",
                 "--serve-command", FAKE_SERVE, "--output-dir", str(out), "--no-progress"])
    assert r.returncode == 0, r.stderr
    for text in ("slow-model (A) vs fast-model (B)", "## concurrency 1", "## concurrency 2",
                 "task latency p90 (s)", "tasks / hour", "TTFT mean", "ITL mean", "cache bytes / token",
                 "utilisation", "idle gaps", "Where the difference comes from"):
        assert text in r.stdout, text
    res = json.loads((out / "compare.json").read_text())
    rows = {m: ratio for m, a, b, ratio in res["rows"]["1"]}
    # A sleeps 10x longer per token (0.02 vs 0.002 s); scheduling delay on a busy machine adds to
    # both, so ask for the right order with a clear margin, not the full 10x
    assert float(rows["TPOT mean"].rstrip("×")) > 1.5
    assert float(rows["tasks / hour"].rstrip("×")) < 1
    assert any("decode" in line for line in res["explanation"])
    assert "identical recorded agentic workload" in res["explanation"][0]
    for name in ("slow-model", "fast-model"):
        for c in ("c1", "c2"):
            s = json.loads((out / name / c / "summary.json").read_text())
            assert s["validity"]["valid"] and s["sessions"]["completed"] == int(c[1]) + 1
        m = json.loads((out / name / "c1" / "manifest.json").read_text())
        assert m["server_command"][-2:] == ["--token-delay", "0.002"] and m["seed"] == 0
    # same seeded workload on both: identical prompts and output lengths request by request
    a = [json.loads(x) for x in (out / "slow-model" / "c1" / "requests.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (out / "fast-model" / "c1" / "requests.jsonl").read_text().splitlines()]
    key = lambda r: (r["request_id"], r["input_tokens"], r["output_tokens"])  # noqa: E731
    assert sorted(map(key, a)) == sorted(map(key, b))
    assert (out / "report.html").is_file() and (out / "compare.md").is_file()
    pids = server_pids(out)
    assert len(pids) == 2 and all(gone(p) for p in pids)


def test_compare_url_targets_are_used_as_is(fake_server, tmp_path):
    out = tmp_path / "urls"
    r = run_cli(["compare", fake_server.url, fake_server.url + "/v1", "--scale", "small",
                 "--concurrency", "1", "--output-dir", str(out), "--no-progress", "--no-telemetry"])
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert len(names) == 2 and all("127.0.0.1" in n for n in names)


def test_compare_stops_servers_on_ctrl_c(tmp_path):
    out = tmp_path / "int"
    code = ("import sys; from flashlane.cli import compare; import argparse\n"
            "ap = argparse.ArgumentParser(); sub = ap.add_subparsers(); compare.add_parser(sub)\n"
            "a = ap.parse_args(sys.argv[1:]); sys.exit(a.func(a))\n")
    proc = subprocess.Popen([sys.executable, "-c", code, "compare", "slow-a", "slow-b", "--scale", "medium",
                             "--serve-command", FAKE_SERVE, "--output-dir", str(out), "--no-progress"],
                            cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        children = []
        while time.monotonic() < deadline:
            children = [c for c in psutil.Process(proc.pid).children(recursive=True)]
            # the first load point's folder appears when its measurement starts: Ctrl-C lands inside it
            if len(children) >= 2 and (out / "slow-a" / "c1").exists():
                break
            time.sleep(0.2)
        time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "servers stopped" in err
    # the servers were stopped before compare exited; their own children may take the init
    # process a moment to reap on a busy machine: wait for that, not for a fixed time
    wait_until = time.monotonic() + 15
    while not all(gone(c.pid) for c in children) and time.monotonic() < wait_until:
        time.sleep(0.1)
    assert children and all(gone(c.pid) for c in children)


@pytest.mark.slow
def test_flashlane_compare_default_targets_small_scale(tmp_path):
    """`flashlane compare --scale small --stacks flashlane` end to end: tiny-flash vs tiny-standard,
    started here, over a concurrency sweep. The simulation beside it is calibrated on the quick
    grid, whose decode batches 1 and 4 reach the sweep's concurrency, as the stacks test's is, so
    the two share a calibration: from an empty cache the compare grid made this test 518 s of a
    39-minute suite (464 s on the quick grid) and the stacks test 295 s (161 s). What the compare
    grid adds is grid points; its arguments are tested in ``test_simulate_cli``."""
    out = tmp_path / "e2e"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "flashlane.cli.main", "compare", "--scale", "small",
                        "--stacks", "flashlane", "--no-profile", "--calibration-grid", "quick",
                        "--output-dir", str(out), "--no-progress"],
                       capture_output=True, text=True,
                       timeout=900, cwd=Path(__file__).resolve().parent.parent)
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tiny-flash (A) vs tiny-standard (B)" in r.stdout
    for c in ("1", "2", "4"):
        assert f"## flashlane — concurrency {c}" in r.stdout
    for name in ("tiny-flash", "tiny-standard"):
        for c in ("c1", "c2", "c4"):
            s = json.loads((out / "flashlane" / name / c / "summary.json").read_text())
            assert s["errors"]["total"] == 0 and s["sessions"]["completed"] == int(c[1]) + 1
            assert s["server_info"]["cache_bytes_per_token"]
    assert (out / "report.html").is_file()
    pids = server_pids(out)
    assert len(pids) == 2 and all(gone(p) for p in pids)
    print(f"\ncompare --scale small took {elapsed:.0f} s\n{r.stdout}")
