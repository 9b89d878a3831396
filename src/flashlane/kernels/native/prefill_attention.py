"""Causal attention of a bf16 prefill chunk straight from its sequence's paged K|V rows on AMX
tiles (``prefill_attention_amx.cpp``): no gathered copy of the history, one pass over the keys
per block of 16 query rows with an online softmax, and blocks past a row's position skipped.
The cpu backend's dense attention takes it for prefill chunks where the pool is bf16 and the CPU
and OS allow AMX; torch's flash kernel otherwise."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import OPENMP, load, why_unavailable
from .row_split import team_threads

_P, _I = ctypes.c_void_p, ctypes.c_int64
MAX_HEAD_DIM = 128     # the kernel's per-row buffers


@functools.lru_cache(maxsize=1)
def _functions():
    lib = load("prefill_attention_amx", row_gemm.AMX_FLAGS + OPENMP)
    pack, attend = lib.prefill_attention_pack, lib.prefill_attention_amx
    pack.argtypes, pack.restype = [_P, _I, _P, _I, _I, _I, _I, _P, _P, _I], None
    attend.argtypes = [_P, _I, _P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, _I, _I, _I]
    attend.restype = None
    for size in (lib.prefill_keys_size, lib.prefill_values_size):
        size.argtypes, size.restype = [_I, _I], _I
    return pack, attend, lib.prefill_keys_size, lib.prefill_values_size


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can): it needs AMX."""
    return why_unavailable(row_gemm.amx_unavailable(), _functions)


def supports(q: torch.Tensor, pool: torch.Tensor, pool_scale: torch.Tensor | None) -> bool:
    """bf16 queries (heads and head dims contiguous) and pool (no int8 scales), head dim a
    multiple of 32 up to 128, eager, no autograd."""
    d = q.shape[-1]
    return (q.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16 and pool_scale is None
            and q.device.type == "cpu" and d % 32 == 0 and d <= MAX_HEAD_DIM and pool.stride(-1) == 1
            and q.stride(-1) == 1 and q.stride(-2) == d
            and not torch.compiler.is_compiling() and not row_gemm.tracks_grad(q) and unavailable() is None)


def prefill_attention(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, start: int, num_kv: int,
                      page_size: int, out: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """q [Q, Hq, D] (one sequence's chunk at positions ``start..``, its K|V already in the pool;
    tokens may be strided, heads and D contiguous) -> ``out`` [Q, Hq, D] (the same layout): each
    query over the sequence's keys up to its own position, read through ``table`` (its pages)."""
    n, num_heads, d = q.shape
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv} kv heads")
    if q.stride(2) != 1 or q.stride(1) != d or out.stride(2) != 1 or out.stride(1) != d:
        raise ValueError("q and out need contiguous heads and head dims")
    why = unavailable()              # also asks the OS for the tile state, once
    if why is not None:
        raise RuntimeError(f"the AMX prefill attention cannot run here: {why}")
    table = table if table.dtype == torch.int64 and table.is_contiguous() else table.to(torch.int64).contiguous()
    scale = d ** -0.5 if scale is None else scale
    pack, attend, keys_size, values_size = _functions()
    total = start + n
    # each kv head's keys and values packed once (the heads split over the threads), into buffers
    # every thread reads
    keys = torch.empty(num_kv * keys_size(total, d), dtype=torch.int32)
    values = torch.empty(num_kv * values_size(total, d), dtype=torch.int16)
    pack(pool.data_ptr(), pool.stride(0), table.data_ptr(), page_size, total, num_kv, d, keys.data_ptr(),
         values.data_ptr(), team_threads(num_kv, 1))
    # then each kv head's query blocks in `parts` interleaved shares, so the threads get even work
    # whatever the number of kv heads (3 heads over 2 threads would be 2 against 1)
    parts = max(1, min(torch.get_num_threads(), -(-n // 16)))

    attend(q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), start, n, num_heads, num_kv, d, scale,
           out.data_ptr(), out.stride(0), parts, team_threads(num_kv * parts, 1))
    return out
