"""Telemetry pieces: Prometheus parsing, process-tree CPU, NVML sampling (fake pynvml module)."""

import os
import subprocess
import sys
import time
import types

import pytest

from flashlane.bench.runner import BenchConfig, analyse_telemetry, server_cache_info
from flashlane.bench.telemetry import Telemetry, _ProcTree, parse_prometheus


def test_parse_prometheus_keeps_every_numeric_sample():
    text = ("# HELP x y\n# TYPE flashlane:num_requests_running gauge\n"
            'flashlane:num_requests_running{model_name="m"} 3\n'
            "flashlane:prompt_tokens_total 1.5e3\n"
            'lat_bucket{le="+Inf"} 7\n'
            "weird NaN\n"
            "with_ts 4 1700000000000\n"
            "garbage line here\n")
    got = parse_prometheus(text)
    assert got['flashlane:num_requests_running{model_name="m"}'] == 3.0
    assert got["flashlane:prompt_tokens_total"] == 1500.0
    assert got['lat_bucket{le="+Inf"}'] == 7.0 and got["with_ts"] == 4.0
    assert "weird" in got and "garbage" not in got


def test_a_process_first_seen_only_primes_its_cpu_counter(monkeypatch):
    """Reading the counter right after priming it divides a clock tick of CPU by microseconds
    of wall time: a fresh client once reported "3116% of a core" and failed a run's validity."""
    import psutil

    calls = []
    monkeypatch.setattr(psutil.Process, "cpu_percent", lambda self, interval=None: calls.append(self.pid) or 3116.0)
    tree = _ProcTree(os.getpid(), children=False)
    cpu, rss = tree.sample()
    assert cpu == 0.0 and rss > 0 and len(calls) == 1
    assert tree.sample()[0] == 3116.0 and len(calls) == 2   # from the second sample on, it is read


def test_process_tree_cpu_tells_busy_from_idle():
    # Both say when the interpreter is up, so its start-up CPU stays out of the measured window
    # (it made the idle one look busy on a slow machine). A busy machine shares its cores, so
    # the spinning one is asked for a fifth of a core, not most of one.
    up = "import sys, time; print('up', flush=True); "
    busy = subprocess.Popen([sys.executable, "-c", up + "\nwhile True: pass"], stdout=subprocess.PIPE, text=True)
    idle = subprocess.Popen([sys.executable, "-c", up + "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline() == idle.stdout.readline() == "up\n"
        tb, ti = _ProcTree(busy.pid), _ProcTree(idle.pid)
        tb.sample(), ti.sample()
        time.sleep(1.0)
        (cpu_b, rss_b), (cpu_i, _) = tb.sample(), ti.sample()
        assert cpu_b > 20 and cpu_i < 5 and rss_b > 1 << 20, (cpu_b, cpu_i)
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    assert tb.sample() is None  # gone


def fake_pynvml(util_values, energy_mj):
    state = {"i": 0}
    m = types.ModuleType("pynvml")
    m.nvmlInit = lambda: None
    m.nvmlDeviceGetCount = lambda: 1
    m.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    m.nvmlDeviceGetName = lambda h: "Fake GPU"

    def util(h):
        v = util_values[min(state["i"], len(util_values) - 1)]
        return types.SimpleNamespace(gpu=v)

    def energy(h):
        v = energy_mj[min(state["i"], len(energy_mj) - 1)]
        state["i"] += 1
        return v

    m.nvmlDeviceGetUtilizationRates = util
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=123)
    m.nvmlDeviceGetPowerUsage = lambda h: 250_000
    m.nvmlDeviceGetTotalEnergyConsumption = energy
    return m


def test_nvml_utilisation_drives_idle_gaps(monkeypatch):
    util = [90, 90, 0, 0, 0, 0, 90, 90]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(util, [1000 * i for i in range(8)]))
    tel = Telemetry("http://127.0.0.1:9", server_pid=None, sample_interval_s=0.1)
    assert tel.utilisation_series == "gpu0.util" and tel.hardware()["gpus"] == ["Fake GPU"]
    for i in range(len(util)):
        tel.sample_once()
        # place samples on a known 0.1 s grid
        tel.samples[-4:] = [(i * 0.1, s, n, v) for _, s, n, v in tel.samples[-4:]]
    cfg = BenchConfig(base_url="http://x", output_dir="o", concurrency=[1], min_gap_s=0.2)
    summary, gaps, series = analyse_telemetry(tel, [], 0.0, 0.75, cfg)
    assert [(round(g["start"], 2), round(g["end"], 2), g["cls"]) for g in gaps] == [(0.1, 0.5, "A")]
    assert summary["gpus_summary"]["gpu0"]["energy_j"] == pytest.approx(7.0)
    assert summary["gpus_summary"]["gpu0"]["power_w_mean"] == 250.0
    assert summary["busy_overall"] == pytest.approx(0.9 * 3 / 7)


def test_server_cache_info_prefers_exact_keys():
    doc = {"data": [{"id": "m", "flashlane": {"latent_bytes_per_token": 256, "cache_bytes_per_token": 320.0,
                                              "state_bytes_per_sequence": 128000, "dtype": "float32"}}]}
    assert server_cache_info(doc, {}) == {"cache_bytes_per_token": 320.0, "state_bytes_per_sequence": 128000.0,
                                          "dtype": "float32"}
    got = server_cache_info({"data": []}, {'x:cache_bytes_per_token{m="a"}': 64.0})
    assert got == {"cache_bytes_per_token": 64.0, "state_bytes_per_sequence": None, "dtype": None}
