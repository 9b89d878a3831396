"""The KDA recurrence of every sequence of a step (decode tokens and prefill chunks) through
``kda_recurrent.cpp``: token by token from each sequence's state row, in one call. Returns None
where the inputs are not its case (another device or state dtype, inside a compiled graph,
autograd recording, or the kernel unavailable) and the caller runs the torch kernels."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import OPENMP, load, why_unavailable
from .row_split import team_threads

_P, _I = ctypes.c_void_p, ctypes.c_int64
# tokens a thread's share of the step's (sequence, head) pairs should cover on average: decode
# steps (a token per sequence) stay on one thread, a prefill chunk's heads split
_PART_TOKENS = 64


@functools.lru_cache(maxsize=1)
def _function():
    fn = load("kda_recurrent", row_gemm.ARCH_FLAGS + OPENMP).kda_recurrent_f32
    fn.argtypes, fn.restype = [_P, _P, _P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _P, _I], None
    return fn


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return why_unavailable(row_gemm.cpu_unavailable(), _function)


def kda_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               rec_state: torch.Tensor, cu_q: torch.Tensor, slots: torch.Tensor,
               fresh: torch.Tensor) -> torch.Tensor | None:
    """q, k, g [N, H, Dk], v [N, H, Dv], beta [N, H]; sequence b is rows cu_q[b]:cu_q[b+1] with its
    state in ``rec_state[slots[b]]`` ([S, H, Dk, Dv] float32, updated in place; ignored where
    ``fresh[b]``) -> o [N, H, Dv] in v's dtype, or None."""
    if (rec_state.dtype != torch.float32 or rec_state.device.type != "cpu" or q.device.type != "cpu"
            or not rec_state[0].is_contiguous() or torch.compiler.is_compiling()
            or row_gemm.tracks_grad(q, k, v, g, beta) or unavailable()):
        return None
    n, heads, dk = q.shape
    dv = v.shape[-1]
    if rec_state.shape[1:] != (heads, dk, dv) or rec_state.stride(0) != heads * dk * dv:
        return None
    qf, kf, vf, gf, bf = (t.float().contiguous() for t in (q, k, v, g, beta))
    cu = cu_q.to(torch.int64).contiguous()
    rows = slots.to(torch.int64).contiguous()
    new = fresh.to(torch.uint8).contiguous()
    out = torch.empty(n, heads, dv, dtype=torch.float32)
    fn = _function()
    pairs = rows.shape[0] * heads
    fn(qf.data_ptr(), kf.data_ptr(), vf.data_ptr(), gf.data_ptr(), bf.data_ptr(), cu.data_ptr(), rows.shape[0],
       rows.data_ptr(), new.data_ptr(), rec_state.data_ptr(), heads, dk, dv, out.data_ptr(),
       team_threads(pairs, -(-pairs * _PART_TOKENS // max(n, 1))))
    return out.to(v.dtype)
