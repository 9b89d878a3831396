"""The torch thread count the offline commands and `serve` take when --num-threads is not given
(the CPUs not busy at start-up less one), the passive OpenMP waiting, and the start-up lines."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch

from flashlane.cli.engine_flags import apply_thread_default
from flashlane.cli.main import main
from flashlane.engine import threads


@pytest.mark.parametrize("cpus, busy, expected", [
    (2, 0.0, 1), (2, 0.4, 1), (2, 2.0, 1), (2, None, 1), (1, 0.0, 1),
    (4, 0.1, 3), (4, 1.2, 2), (16, 3.4, 12), (16, None, 15),
])
def test_default_counts_the_cpus_not_busy_less_one(cpus, busy, expected):
    assert threads.default_threads(cpus, busy) == expected


def test_busy_machine_warning():
    assert threads.ThreadChoice(1, 2, 1.5, "x").warning().startswith(
        "warning: the machine is busy (load average 1.50 on 2 CPUs)")
    assert threads.ThreadChoice(2, 2, 0.9, "x").warning() is None
    assert threads.ThreadChoice(2, 2, None, "x").warning() is None


def test_given_count_is_kept_and_a_loaded_torch_keeps_its_own(capsys):
    args = argparse.Namespace(num_threads=3)
    apply_thread_default(args)
    assert args.num_threads == 3 and "threads: 3 torch threads (--num-threads;" in capsys.readouterr().err
    args = argparse.Namespace(num_threads=None)   # torch runs in this test process already
    apply_thread_default(args)
    assert args.num_threads is None
    assert f"threads: {torch.get_num_threads()} torch thread" in capsys.readouterr().err


def test_num_threads_must_be_at_least_one(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "tiny-flash", "--prompt", "hi", "--num-threads", "0"])
    assert "argument --num-threads: must be >= 1" in capsys.readouterr().err


FRESH_PROCESS = """
import os, sys
from flashlane.engine import threads
threads.busy_cpus = lambda cpus: 0.0   # an idle machine
threads.load_average = lambda: 2.0 * len(threads.usable_cpus())
from flashlane.cli.main import main
assert main(["generate", "--model", "tiny-flash", "--prompt-token-ids", "1,2", "--max-tokens", "1",
             "--dtype", "float32", "--cache-memory", str(32 << 20), "--max-model-len", "64"]) == 0
import torch
print("torch threads", torch.get_num_threads(), "policy", os.environ.get("OMP_WAIT_POLICY"), file=sys.stderr)
"""


def test_a_fresh_process_takes_the_free_cores_less_one_and_sleeping_waits():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    r = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    cpus = len(threads.usable_cpus())
    n = max(1, cpus - 1)   # 1 on the 2-core CI machine, where torch alone would take 2
    assert (f"threads: {n} torch thread{'s' if n > 1 else ''} (default: CPUs not busy at start-up, less one; "
            f"--num-threads N to change; {cpus} CPUs, 0.0 busy, load average {2.0 * cpus:.2f}; "
            "OMP_WAIT_POLICY PASSIVE)") in lines
    assert f"warning: the machine is busy (load average {2.0 * cpus:.2f} on {cpus} CPUs): speeds will be lower " \
        "than on an idle machine and vary from run to run" in lines
    assert f"torch threads {n} policy PASSIVE" in lines


def test_busy_cores_are_sampled_not_averaged():
    cpus = threads.usable_cpus()
    busy = threads.busy_cpus(cpus)
    assert busy is not None and 0.0 <= busy <= len(cpus)
