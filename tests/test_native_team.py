"""Native kernels split their rows over torch's OpenMP team (``native/parallel.h``): the mHC
kernels, the KDA recurrence, the short convolution, RMSNorm / RoPE, bf16 SwiGLU, the indexer's
scores and top-k, paged decode attention, the AMX prefill attention and the AMX few-row linear
give the same numbers on two threads as on one (each row, token or head is computed on its own),
the split really happens (``team_threads``), decode-sized work stays on one thread, and the
kernels share torch's OpenMP runtime instead of starting a team of their own."""

from __future__ import annotations

import ctypes
import sys

import pytest
import torch

from flashlane.kernels.native import (build, index_scores, kda_recurrent, mhc_weights, norm_rope, paged_attention,
                                      prefill_attention, row_gemm, row_split, swiglu, top_pools)
from flashlane.kernels.native import short_conv as short_conv_native

KERNELS = (mhc_weights, kda_recurrent, short_conv_native, norm_rope, swiglu, index_scores, top_pools, paged_attention)
why = next((k.unavailable() for k in KERNELS if k.unavailable()), None)
pytestmark = pytest.mark.skipif(why is not None, reason=f"native kernel unavailable: {why}")
WHY_NO_AMX = prefill_attention.unavailable() or row_gemm.amx_unavailable()


def _on(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _equal(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def _cases():
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def mhc(n, dtype):
        X = torch.randn(1500, n, 64, generator=g).to(dtype)
        fn, base = torch.randn((2 + n) * n, n * 64, generator=g) * 0.05, torch.randn((2 + n) * n, generator=g)
        scale, y = torch.rand(3, generator=g), torch.randn(1500, 64, generator=g).to(dtype)

        def run():
            collapsed, post, comb = mhc_weights.hc_pre(X, fn, base, scale, norm_eps=1e-6, hc_eps=1e-6,
                                                       sinkhorn_iters=20)
            return collapsed, post, comb, mhc_weights.mhc_post(y, X, post, comb)
        return run

    def kda(lens):
        n, heads = sum(lens), 4
        q, k, gate = (torch.randn(n, heads, 16, generator=g) for _ in range(3))
        v, beta = torch.randn(n, heads, 16, generator=g), torch.rand(n, heads, generator=g)
        state = torch.randn(6, heads, 16, 16, generator=g)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        slots, fresh = torch.tensor([4, 1, 3][: len(lens)]), torch.tensor([True, False, False][: len(lens)])

        def run():
            s = state.clone()
            return kda_recurrent.kda_varlen(q, k, v, -gate.abs(), beta, s, cu, slots, fresh), s
        return run

    def conv(lens):
        n, channels = sum(lens), 96
        x, w = torch.randn(n, channels, generator=g).to(bf), torch.randn(channels, 1, 4, generator=g).to(bf)
        state = torch.randn(5, channels, 3, generator=g).to(bf)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        slots, fresh = torch.tensor([2, 0, 4][: len(lens)]), torch.tensor([False, True, False][: len(lens)])

        def run():
            s = state.clone()
            return short_conv_native.short_conv_varlen(x, w, s, cu, slots, fresh), s
        return run

    x, w = torch.randn(3000, 64, generator=g).to(bf), torch.randn(64, generator=g).to(bf)
    heads = torch.randn(3000, 5, 32, generator=g).to(bf)[:, :3]          # strided rows and heads
    cos, sin = torch.randn(3000, 32, generator=g).to(bf), torch.randn(3000, 32, generator=g).to(bf)
    gate, up = torch.randn(700, 256, generator=g).to(bf), torch.randn(700, 256, generator=g).to(bf)
    def scores():
        q, w = torch.randn(2, 600, 2, 32, generator=g), torch.randn(2, 600, 2, generator=g)
        keys, picks = torch.randn(2, 1500, 32, generator=g), torch.randn(300, 2048, generator=g)
        return lambda: (index_scores.index_scores(q, w, keys, 0.2), top_pools.top_pools(picks, 64))

    def decode(dtype):
        pool = torch.randn(4096, 2 * 3 * 64, generator=g).to(dtype)
        lens = torch.tensor([1500, 37, 2000, 900])
        tables = torch.stack([torch.randperm(4096 // 16, generator=g)[:125] for _ in lens])
        q = torch.randn(len(lens), 9, 64, generator=g)
        return lambda: paged_attention.decode_attention(q, pool, tables, lens, 3, 16)

    def amx():
        pool = torch.randn(80 * 16, 2 * 3 * 64, generator=g).bfloat16()
        table, q = torch.randperm(80, generator=g)[:72], torch.randn(900, 9, 64, generator=g).bfloat16()
        x, w = torch.randn(8, 576, generator=g).bfloat16(), torch.randn(1536, 576, generator=g).bfloat16()
        return lambda: (prefill_attention.prefill_attention(q, pool, table, 250, 3, 16, torch.empty_like(q)),
                        row_gemm.linear(x, w, None))

    return {
        "index scores and top-k": scores(), "decode attention fp32": decode(torch.float32),
        "decode attention bf16": decode(bf), "amx prefill attention and linear": amx(),
        "mhc 4 streams bf16": mhc(4, bf), "mhc 2 streams fp32": mhc(2, torch.float32), "mhc 3 streams": mhc(3, bf),
        "kda one prefill": kda([2048]), "kda prefill among decodes": kda([1, 900, 3]),
        "conv one prefill": conv([2048]), "conv prefill among decodes": conv([1, 700, 2]),
        "rms_norm": lambda: norm_rope.rms_norm(x, w, 1e-5),
        "rope": lambda: norm_rope.rope_rotate_half(heads, cos, sin),
        "swiglu": lambda: (swiglu.swiglu(gate, up), swiglu.swiglu(gate, up, 7.0)),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_two_threads_give_the_numbers_of_one(name):
    if name.startswith("amx") and WHY_NO_AMX:
        pytest.skip(f"AMX kernels unavailable: {WHY_NO_AMX}")
    run = _cases()[name]
    one = _on(1, run)
    assert _equal(one, _on(2, run)), name
    assert not any(t is None for t in (one if isinstance(one, (tuple, list)) else [one])), name


def test_prefill_work_takes_the_team_and_decode_work_stays_on_one_thread(monkeypatch):
    asked = []
    real = row_split.team_threads

    def recorded(rows: int, min_rows: int) -> int:
        asked.append(real(rows, min_rows))
        return asked[-1]
    monkeypatch.setattr(row_split, "team_threads", recorded)       # team_threads_by_values asks it too
    for module in KERNELS:
        if hasattr(module, "team_threads"):
            monkeypatch.setattr(module, "team_threads", recorded)
    _on(2, _cases()["mhc 4 streams bf16"])
    _on(2, _cases()["kda one prefill"])
    _on(2, _cases()["index scores and top-k"])
    _on(2, _cases()["decode attention bf16"])
    assert asked and all(t == 2 for t in asked)
    asked.clear()
    g = torch.Generator().manual_seed(1)
    one_token = torch.randn(1, 4, 64, generator=g).to(torch.bfloat16)
    _on(2, lambda: mhc_weights.hc_pre(one_token, torch.randn(24, 256, generator=g), torch.randn(24, generator=g),
                                      torch.rand(3, generator=g), norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20))
    _on(2, lambda: norm_rope.rms_norm(torch.randn(4, 576, generator=g), torch.randn(576, generator=g), 1e-5))
    assert asked and all(t == 1 for t in asked)


def test_a_second_openmp_runtime_keeps_the_kernels_on_one_thread(monkeypatch):
    monkeypatch.setattr(row_split, "_one_openmp_runtime", lambda: False)
    assert _on(2, lambda: row_split.team_threads(4096, 64)) == 1
    monkeypatch.setattr(row_split, "_one_openmp_runtime", lambda: True)
    assert _on(2, lambda: row_split.team_threads(4096, 64)) == 2
    assert _on(2, lambda: row_split.team_threads(100, 64)) == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")
def test_the_kernels_share_torchs_openmp_runtime():
    for kernel in KERNELS:
        assert kernel.unavailable() is None
    runtimes = build.openmp_runtimes()
    assert len(runtimes) == 1, runtimes          # torch's, which every OpenMP kernel resolved to
    assert row_split._one_openmp_runtime()


def test_a_compiler_without_openmp_builds_the_kernels_single_threaded(monkeypatch, tmp_path):
    try:
        cxx = build.compiler()
    except build.NativeUnavailable:
        pytest.skip("no C++ compiler on this machine")
    refuses = tmp_path / "no-openmp-c++"       # a compiler that knows no -fopenmp
    refuses.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {cxx} "$@"\n')
    refuses.chmod(0o755)
    (tmp_path / "parallel.h").write_text((build.HERE / "parallel.h").read_text())
    (tmp_path / "parts.cpp").write_text(
        '#include "parallel.h"\n#include <atomic>\n'
        'extern "C" int64_t parts(int64_t rows, int64_t threads) {\n'
        '    std::atomic<int64_t> n{0};\n'
        '    parallel_rows(rows, threads, [&](int64_t, int64_t) { n++; });\n'
        '    return n;\n}\n')
    monkeypatch.setattr(build, "HERE", tmp_path)
    for compiler, expected in ((cxx, 2), (str(refuses), 1)):
        monkeypatch.setenv("CXX", compiler)
        monkeypatch.setenv("FLASHLANE_CACHE", str(tmp_path / f"cache-{expected}"))   # same --version: own caches
        build.load.cache_clear()
        fn = build.load("parts", build.OPENMP).parts
        fn.restype = ctypes.c_int64
        assert fn(ctypes.c_int64(100), ctypes.c_int64(2)) == expected, compiler
    build.load.cache_clear()
