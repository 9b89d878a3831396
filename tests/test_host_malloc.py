"""The engine process keeps freed activations mapped (engine/host_malloc.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from engine_models import tiny_llama
from flashlane.engine.host_malloc import TRIM_THRESHOLD, keep_freed_memory
from flashlane.engine.llm import LLM

# A step's pattern in miniature, in a fresh process (glibc's state is per process): four 6 MiB
# activations live at once, freed, again and again; the page faults of the last rounds against
# the pages one round touches
ROUNDS = textwrap.dedent("""
    import ctypes, resource, sys
    from flashlane.engine.host_malloc import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory().kept
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, faults = 6 << 20, []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(size) for _ in range(4)]
        for b in blocks:
            ctypes.memset(b, 1, size)
        for b in blocks:
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(sum(faults[3:]) / 3 / (4 * size / 4096))
""")


def _fault_share(mode: str) -> float:
    # glibc as it comes: no preloaded allocator, no malloc tuning from the environment
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "GLIBC_TUNABLES") and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_freed_activations_stay_mapped_where_glibc_would_fault_them_in_again():
    if keep_freed_memory(environ={}).why.startswith("the C library is not glibc"):
        pytest.skip("needs glibc")
    assert _fault_share("default") > 0.5       # glibc's defaults: each round maps its pages anew
    assert _fault_share("keep") < 0.05


def test_another_allocator_or_the_environment_is_left_alone():
    for env in ({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}, {"LD_PRELOAD": "libjemalloc.so.2:x.so"}):
        got = keep_freed_memory(environ=env, platform="linux")
        assert not got.kept and "preloaded" in got.why
    for env in ({"MALLOC_TRIM_THRESHOLD_": "1"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}):
        got = keep_freed_memory(environ=env, platform="linux")
        assert not got.kept and "left as set" in got.why
    got = keep_freed_memory(environ={}, platform="darwin")
    assert not got.kept and "darwin" in got.why


def test_the_engine_sets_it_and_says_so():
    llm = LLM(tiny_llama(), dtype="float32")
    info = llm.engine.info.host_malloc
    assert info == keep_freed_memory().as_dict()
    if info["kept"]:
        assert f"{TRIM_THRESHOLD >> 20} MiB" in info["why"]
    assert f"host malloc: {info['why']}" in llm.engine.describe_weights()
    assert llm.engine.startup["host_malloc"] == info
