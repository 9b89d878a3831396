"""Causal attention of a float32 prefill chunk straight from its sequence's paged K|V rows
(``prefill_attention_f32.cpp``): keys packed once per kv head, history and chunk in one pass per
block of query rows (the kv head's G query heads times a run of positions) with an online
softmax, register-blocked FMA micro-kernels for scores and values, blocks past a row's position
skipped. torch's flash kernel, which the cpu backend's dense attention uses otherwise, splits a
chunk after cached history into two calls merged afterwards and runs each query head alone.

Two builds of one source (``simd_variants``): ``avx512`` where the CPU has it, else ``avx2``.
Measured against torch's flash kernel on one Emerald Rapids core, SmolLM2's shapes (9 query heads
on 3 kv heads, head dim 64), causal, 1K and 4K tokens: avx512 118-127 against 80-108 GFLOP/s; the
avx2 build with torch and MKL held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``,
as on an AVX2-only CPU) 61-65 against 45-59."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import OPENMP, load
from .row_split import team_threads
from .simd_variants import VARIANT_FLAGS, Variants

_P, _I = ctypes.c_void_p, ctypes.c_int64
MAX_HEAD_DIM = 256     # the kernel's per-row buffers


@functools.lru_cache(maxsize=None)
def _library(variant: str):
    lib = load("prefill_attention_f32", VARIANT_FLAGS[variant] + OPENMP)
    lib.prefill_f32_pack.argtypes = [_P, _I, _P, _I, _I, _I, _I, _P, _P, _I]
    lib.prefill_f32_attend.argtypes = [_P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _I, _I, _I]
    lib.prefill_f32_pack.restype = lib.prefill_f32_attend.restype = None
    for name in ("prefill_f32_keys_size", "prefill_f32_values_size"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [_I, _I], _I
    for name in ("prefill_f32_lanes", "prefill_f32_d_multiple", "prefill_f32_max_group"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [], _I
    return lib


_VARIANTS = Variants(_library)
unavailable, best_variant = _VARIANTS.unavailable, _VARIANTS.best


def preferred() -> bool:
    """Whether the cpu backend takes this kernel for float32 prefill chunks here: it builds and
    runs (either build; ahead of torch's kernel at the same instruction set, measured above)."""
    return unavailable() is None


def supports(q: torch.Tensor, pool: torch.Tensor, pool_scale: torch.Tensor | None, num_kv: int,
             variant: str | None = None) -> bool:
    """float32 queries (heads and head dims contiguous) and pool (no int8 scales), head dim a
    multiple of the build's pass width (64 for avx512, 32 for avx2) up to 256, at most 192 query
    heads per kv head, eager, no autograd."""
    if (torch.compiler.is_compiling() or q.dtype != torch.float32 or pool.dtype != torch.float32
            or pool_scale is not None or q.device.type != "cpu" or q.dim() != 3 or q.shape[1] % num_kv
            or row_gemm.tracks_grad(q)):
        return False
    variant = variant or best_variant()
    if unavailable(variant):
        return False
    lib = _library(variant)
    d = q.shape[-1]
    return (d % lib.prefill_f32_d_multiple() == 0 and d <= MAX_HEAD_DIM and q.shape[1] // num_kv
            <= lib.prefill_f32_max_group() and pool.stride(-1) == 1 and q.stride(-1) == 1 and q.stride(-2) == d)


def prefill_attention(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, start: int, num_kv: int,
                      page_size: int, out: torch.Tensor, scale: float | None = None,
                      variant: str | None = None) -> torch.Tensor:
    """q [Q, Hq, D] float32 (one sequence's chunk at positions ``start..``, its K|V already in the
    pool; tokens may be strided, heads and D contiguous) -> ``out`` [Q, Hq, D] (the same layout):
    each query over the sequence's keys up to its own position, read through ``table``."""
    variant = variant or best_variant()
    if not supports(q, pool, None, num_kv, variant):
        raise ValueError(f"the float32 prefill attention ({variant}) does not take q {tuple(q.shape)} "
                         f"{q.dtype} over a {pool.dtype} pool with {num_kv} kv heads")
    n, num_heads, d = q.shape
    if out.stride(2) != 1 or out.stride(1) != d or out.dtype != torch.float32:
        raise ValueError("out needs float32 with contiguous heads and head dims")
    table = table if table.dtype == torch.int64 and table.is_contiguous() else table.to(torch.int64).contiguous()
    scale = d ** -0.5 if scale is None else scale
    lib = _library(variant)
    total = start + n
    keys = torch.empty(num_kv * lib.prefill_f32_keys_size(total, d), dtype=torch.float32)
    values = torch.empty(num_kv * lib.prefill_f32_values_size(total, d), dtype=torch.float32)
    threads = torch.get_num_threads()
    lib.prefill_f32_pack(pool.data_ptr(), pool.stride(0), table.data_ptr(), page_size, total, num_kv, d,
                         keys.data_ptr(), values.data_ptr(), team_threads(num_kv * -(-total // 1024), 1))
    group = num_heads // num_kv
    positions = max(1, lib.prefill_f32_max_group() // group)
    parts = max(1, min(threads, -(-n // positions)))
    lib.prefill_f32_attend(q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), start, n, num_heads,
                           num_kv, d, scale, out.data_ptr(), out.stride(0), parts, team_threads(num_kv * parts, 1))
    return out
