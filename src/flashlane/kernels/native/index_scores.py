"""The DSA indexer's prefill scores through ``index_scores.cpp``: for one sequence's queries q
[G, S, H, D] and head weights w [G, S, H] against its pooled keys [G, M, D],
``sum_h w * ReLU(scale * q_h . k)`` -> [G, S, M] float32, without the per-head products in
memory; rows split over torch's OpenMP team (``parallel.h``). Returns None where the inputs are not
its case (another device, inside a compiled graph, autograd recording, or the kernel
unavailable) and the caller keeps torch's ``_score_pools``. Its sums run in a fixed order, not
torch's GEMM's: scores agree to float32 rounding, not bit for bit.

Two builds of one source (``simd_variants``): ``avx512`` where the CPU has it, else ``avx2``."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import OPENMP, load
from .row_split import team_threads
from .simd_variants import VARIANT_FLAGS, Variants
from .simd_variants import cpu_unavailable as cpu_unavailable   # re-exported: the variant's CPU needs

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=None)
def _library(variant: str):
    lib = load("index_scores", VARIANT_FLAGS[variant] + OPENMP)
    lib.index_scores_f32.argtypes = [_P, _P, _P, _I, _I, _I, _I, ctypes.c_float, _P, _I]
    lib.index_scores_f32.restype = None
    lib.index_scores_block.argtypes, lib.index_scores_block.restype = [], _I
    return lib


_VARIANTS = Variants(_library)
unavailable, best_variant = _VARIANTS.unavailable, _VARIANTS.best


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float,
                 variant: str | None = None) -> torch.Tensor | None:
    variant = variant or best_variant()
    if (q.device.type != "cpu" or torch.compiler.is_compiling() or row_gemm.tracks_grad(q, w, keys)
            or unavailable(variant)):
        return None
    g, s, h, d = q.shape
    m = keys.shape[1]
    qf = q.float().contiguous()
    wf = w.float().contiguous()
    lib = _library(variant)
    width = lib.index_scores_block()
    blocks = -(-m // width)
    kb = torch.zeros(g, blocks * width, d, dtype=torch.float32)
    kb[:, :m] = keys
    kb = kb.view(g, blocks, width, d).transpose(2, 3).contiguous()     # [G, blocks, D, width]
    out = torch.empty(g, s, m, dtype=torch.float32)
    fn = lib.index_scores_f32
    threads = team_threads(s, 16)
    for b in range(g):
        fn(qf[b].data_ptr(), wf[b].data_ptr(), kb[b].data_ptr(), s, h, d, m, scale, out[b].data_ptr(), threads)
    return out
