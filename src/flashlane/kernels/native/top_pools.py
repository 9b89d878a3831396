"""The indexer's top-k (prefill blocks, eager decode rows) through ``top_pools.cpp``: per row,
the indices of the ``n`` highest scores, highest first, equal scores lower index first (what
``indexer._top_pools`` computes with torch's topk and two sorts), rows split over torch's OpenMP
team (``parallel.h``). Returns None where the inputs are not its case (another device or dtype,
inside a compiled graph, autograd recording, or the kernel unavailable) and the caller keeps
torch's path. Scores must hold no NaN (they are ReLU'd sums, or -inf where masked)."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import OPENMP, load, why_unavailable
from .row_split import team_threads

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=1)
def _function():
    fn = load("top_pools", row_gemm.ARCH_FLAGS + OPENMP).top_pools_f32
    fn.argtypes, fn.restype = [_P, _I, _I, _I, _I, _P, _I], None
    return fn


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return why_unavailable(row_gemm.cpu_unavailable(), _function)


def top_pools(scores: torch.Tensor, n: int) -> torch.Tensor | None:
    """scores [..., M] float32 (n <= M) -> int64 [..., n], or None."""
    if (scores.dtype != torch.float32 or scores.device.type != "cpu" or torch.compiler.is_compiling()
            or row_gemm.tracks_grad(scores) or not 0 < n <= scores.shape[-1] < 2**31 or unavailable()):
        return None
    m = scores.shape[-1]
    flat = scores.reshape(-1, m).contiguous()
    rows = flat.shape[0]
    out = torch.empty(rows, n, dtype=torch.int64)
    _function()(flat.data_ptr(), rows, m, m, n, out.data_ptr(), team_threads(rows, 64))
    return out.view(*scores.shape[:-1], n)
