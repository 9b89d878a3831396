"""`flashlane bench` / `flashlane compare` command lines, and the bench's import isolation."""

import json
import subprocess
import sys

from bench_fixtures import run_cli


def test_bench_never_imports_engine_models_server_or_torch():
    code = ("import sys\n"
            "import flashlane.bench.runner, flashlane.bench.compare, flashlane.bench.recompute\n"
            "import flashlane.cli.bench, flashlane.cli.compare\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith("
            "('flashlane.engine', 'flashlane.models', 'flashlane.server', 'flashlane.kernels', 'torch.')))\n"
            "print(bad); sys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_bench_cli_concurrency_sweep_writes_one_folder_per_point(fake_server, tmp_path):
    out = tmp_path / "sweep"
    r = run_cli(["bench", "--base-url", fake_server.url, "--workload", "fixed", "--input-len", "16",
                 "--output-len", "4", "--concurrency", "1,2", "--num-requests", "4", "--seed", "9",
                 "--output-dir", str(out), "--no-progress", "--slo", "ttft=5,e2e=10"])
    assert r.returncode == 0, r.stderr
    assert "| c1 |" in r.stdout and "| c2 |" in r.stdout
    for label in ("c1", "c2"):
        s = json.loads((out / label / "summary.json").read_text())
        m = json.loads((out / label / "manifest.json").read_text())
        assert s["requests"]["completed"] == 4 and s["requests"]["warmup"] == 2 * int(label[1])
        assert m["seed"] == 9 and m["argv"][:2] == ["-c", "bench"] and m["model"] == "fake-model"
        assert m["workload"]["input_tokens"] == 16 and m["load_point"]["concurrency"] == int(label[1])
        assert s["goodput"]["slo"] == {"ttft_s": 5.0, "e2e_s": 10.0}
    sweep = json.loads((out / "sweep_summary.json").read_text())
    assert [p["label"] for p in sweep["points"]] == ["c1", "c2"]


def test_bench_cli_request_rate_sweep_folders(fake_server, tmp_path):
    out = tmp_path / "rates"
    r = run_cli(["bench", "--base-url", fake_server.url, "--model", "fake-model", "--workload", "fixed",
                 "--input-len", "8", "--output-len", "2", "--request-rate", "50,100",
                 "--num-requests", "3", "--output-dir", str(out), "--no-progress", "--no-telemetry"])
    assert r.returncode == 0, r.stderr
    assert (out / "r50" / "summary.json").is_file() and (out / "r100" / "summary.json").is_file()
    assert not (out / "r50" / "telemetry").exists()


def test_bench_cli_bad_input_is_named(fake_server, tmp_path):
    r = run_cli(["bench", "--base-url", fake_server.url, "--concurrency", "0", "--output-dir", str(tmp_path)])
    assert r.returncode == 2 and "--concurrency" in r.stderr
    r = run_cli(["bench", "--base-url", fake_server.url, "--workload", "fixed", "--trace", "x.json",
                 "--output-dir", str(tmp_path)])
    assert r.returncode == 2 and "trace" in r.stderr
    r = run_cli(["bench", "--base-url", fake_server.url, "--trace", str(tmp_path / "none.json"),
                 "--output-dir", str(tmp_path), "--no-progress"])
    assert r.returncode == 2 and "not found" in r.stderr
    r = run_cli(["bench", "--base-url", fake_server.url, "--slo", "speed=3", "--output-dir", str(tmp_path)])
    assert r.returncode == 2 and "slo" in r.stderr
    r = run_cli(["compare", "same", "same", "--output-dir", str(tmp_path)])
    assert r.returncode == 2 and "same target" in r.stderr


def test_bench_cli_unreachable_server(tmp_path):
    from flashlane.bench.server_launch import free_port
    url = f"http://127.0.0.1:{free_port()}"
    r = run_cli(["bench", "--base-url", url, "--output-dir", str(tmp_path / "a"), "--no-progress"])
    assert r.returncode == 2 and "is the server up" in r.stderr
    r = run_cli(["bench", "--base-url", url, "--model", "m", "--scale", "small", "--num-sessions", "1",
                 "--output-dir", str(tmp_path / "b"), "--no-progress"])
    assert r.returncode == 1 and "warmup" in r.stderr and "connection" in r.stderr
    s = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert not s["validity"]["valid"] and "aborted" in s["validity"]["reasons"][0]
