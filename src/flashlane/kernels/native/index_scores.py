"""The DSA indexer's prefill scores through ``index_scores.cpp``: for one sequence's queries q
[G, S, H, D] and head weights w [G, S, H] against its pooled keys [G, M, D],
``sum_h w * ReLU(scale * q_h . k)`` -> [G, S, M] float32, without the per-head products in
memory; rows split over torch's threads (``run_split``). Returns None where the inputs are not
its case (another device, inside a compiled graph, autograd recording, or the kernel
unavailable) and the caller keeps torch's ``_score_pools``. Its sums run in a fixed order, not
torch's GEMM's: scores agree to float32 rounding, not bit for bit."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import load, why_unavailable
from .row_split import run_split

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=1)
def _function():
    fn = load("index_scores", row_gemm.ARCH_FLAGS).index_scores_f32
    fn.argtypes, fn.restype = [_P, _P, _P, _I, _I, _I, _I, ctypes.c_float, _P], None
    return fn


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return why_unavailable(row_gemm.cpu_unavailable(), _function)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor | None:
    if (q.device.type != "cpu" or torch.compiler.is_compiling() or row_gemm.tracks_grad(q, w, keys)
            or unavailable()):
        return None
    g, s, h, d = q.shape
    m = keys.shape[1]
    qf = q.float().contiguous()
    wf = w.float().contiguous()
    blocks = -(-m // 8)
    kb = torch.zeros(g, blocks * 8, d, dtype=torch.float32)
    kb[:, :m] = keys
    kb = kb.view(g, blocks, 8, d).transpose(2, 3).contiguous()     # [G, blocks, D, 8]
    out = torch.empty(g, s, m, dtype=torch.float32)
    fn = _function()
    for b in range(g):
        qb, wb, ob = qf[b], wf[b], out[b]
        run_split(lambda a, count: fn(qb[a:].data_ptr(), wb[a:].data_ptr(), kb[b].data_ptr(), count, h, d, m,
                                      scale, ob[a:].data_ptr()), s, min_rows=16)
    return out
