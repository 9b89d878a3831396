"""Decode attention over a float32 or bfloat16 paged KV pool without gathering it
(``paged_attention.cpp``): per sequence, scores, softmax and values in one native call in float32
(bf16 pool values widened exactly; the output is rounded once to the query's dtype), the
(sequence, kv head) pairs split over torch's OpenMP team when there is enough history to share.
For the decode rows of the dense (llama) attention; the caller keeps torch's path for anything
else (see ``supports``).

Two builds of one source (``simd_variants``): ``avx512`` where the CPU has it, else ``avx2``. The
avx512 build runs bf16 pools sixteen lanes at a time, so its sums differ from the avx2 build's in
the last bits (see the source); float32 pools run alike in both."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import OPENMP, load
from .row_split import team_threads
from .simd_variants import VARIANT_FLAGS, Variants

_P, _I = ctypes.c_void_p, ctypes.c_int64
_DECODE = [_P, _P, _I, _P, _I, _P, _I, _I, _I, _I, ctypes.c_float, _P, _I, _I]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}     # pool dtypes
# history rows (x kv heads) a thread's share should read at least: below it handing work to
# torch's team costs more than the share
_PART_ROWS = 2048


@functools.lru_cache(maxsize=None)
def _functions(variant: str) -> dict[torch.dtype, object]:
    lib = load("paged_attention", VARIANT_FLAGS[variant] + OPENMP)
    fns = {}
    for dtype, suffix in _SUFFIX.items():
        fns[dtype] = fn = getattr(lib, f"paged_decode_{suffix}")
        fn.argtypes, fn.restype = _DECODE, None
    return fns


_VARIANTS = Variants(_functions)
# unavailable(variant=None): why a build (default: this CPU's) cannot run here; None: it can
unavailable, best_variant = _VARIANTS.unavailable, _VARIANTS.best


def _function(pool_dtype: torch.dtype = torch.float32, variant: str | None = None):
    return _functions(variant or best_variant())[pool_dtype]


def supports(q: torch.Tensor, pool: torch.Tensor, pool_scale: torch.Tensor | None) -> bool:
    """Whether these decode rows can take the native path: float32 or bfloat16 queries and pool, a
    plain pool (no int8 scales), head dim a multiple of 8, eager (a ctypes call cannot sit inside
    a compiled graph), no autograd to record."""
    return (q.dtype in _SUFFIX and pool.dtype in _SUFFIX and pool_scale is None
            and q.device.type == "cpu" and q.shape[-1] % 8 == 0 and pool.stride(-1) == 1
            and not torch.compiler.is_compiling() and not row_gemm.tracks_grad(q) and unavailable() is None)


def decode_attention(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                     num_kv: int, page_size: int, scale: float | None = None,
                     history: int | None = None, variant: str | None = None) -> torch.Tensor:
    """q [B, Hq, D] (one new token per sequence, already written to the pool) -> [B, Hq, D]: each
    sequence attends over its ``lens[b]`` tokens read through ``tables[b]`` (``history``:
    ``sum(lens)`` when the caller knows it, as an attention plan shared by all layers does;
    ``variant``: a build other than this CPU's, for tests)."""
    bsz, num_heads, d = q.shape
    if num_heads % num_kv:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv} kv heads")
    out_dtype = q.dtype
    q = q.float().contiguous()
    if tables.dtype != torch.int64 or not tables.is_contiguous():
        tables = tables.to(torch.int64).contiguous()
    if lens.dtype != torch.int64 or not lens.is_contiguous():
        lens = lens.to(torch.int64).contiguous()
    scale = d ** -0.5 if scale is None else scale
    fn = _function(pool.dtype, variant)
    out = torch.empty(bsz, num_heads, d, dtype=torch.float32)
    items, threads = bsz * num_kv, 1
    if torch.get_num_threads() > 1 and items > 1:
        work = (int(lens.sum()) if history is None else history) * num_kv
        threads = team_threads(items, max(1, -(-items * _PART_ROWS // max(work, 1))))
    fn(q.data_ptr(), pool.data_ptr(), pool.stride(0), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
       num_heads, num_kv, d, page_size, scale, out.data_ptr(), items, threads)
    return out if out_dtype == torch.float32 else out.to(out_dtype)
