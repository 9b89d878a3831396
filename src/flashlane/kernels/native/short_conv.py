"""The causal short convolution + SiLU of every sequence of a step (decode tokens and prefill
chunks) through ``short_conv.cpp``, from and into each sequence's conv state, in one call.
Returns None where the inputs are not its case (another device, inside a compiled graph, autograd
recording, or the kernel unavailable) and the caller runs the torch kernels."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import OPENMP, load, why_unavailable
from .row_split import team_threads

_P, _I = ctypes.c_void_p, ctypes.c_int64
# tokens of one sequence a thread's share should hold at least: a prefill chunk's tokens split over
# torch's OpenMP team (``parallel.h``), decode tokens stay on one thread
_PART_TOKENS = 64


@functools.lru_cache(maxsize=1)
def _function():
    fn = load("short_conv", row_gemm.ARCH_FLAGS + OPENMP).short_conv_f32
    fn.argtypes, fn.restype = [_P, _I, _P, _I, _I, _P, _P, _I, _P, _P, _P, _I, _I], None
    return fn


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return why_unavailable(row_gemm.cpu_unavailable(), _function)


def short_conv_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_q: torch.Tensor,
                      slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor | None:
    """x [N, C]; weight [C, 1, K] or [C, K]; sequence b is rows cu_q[b]:cu_q[b+1] with its state in
    ``conv_state[slots[b]]`` ([S, C, K-1], updated in place; ignored where ``fresh[b]``) -> SiLU(conv)
    [N, C] in x's dtype, or None. The arithmetic is float32 as in ``kernels.short_conv``; a state
    pool of another float dtype (bf16 under a bf16 model) is read into float32 rows for the call
    and written back, which is exact: the state holds earlier inputs, already of x's dtype."""
    w = weight.squeeze(1) if weight.dim() == 3 else weight
    if (not conv_state.is_floating_point() or conv_state.device.type != "cpu" or x.device.type != "cpu"
            or x.dim() != 2 or w.dim() != 2 or w.shape[0] != x.shape[1]
            or conv_state.shape[1:] != (x.shape[1], w.shape[1] - 1) or w.shape[1] < 2
            or not conv_state[0].is_contiguous() or conv_state.stride(0) != x.shape[1] * (w.shape[1] - 1)
            or torch.compiler.is_compiling() or row_gemm.tracks_grad(x, w) or unavailable()):
        return None
    xf = x.float()
    xf = xf if xf.stride(-1) == 1 else xf.contiguous()
    wf = w.float().contiguous()
    cu = cu_q.to(torch.int64).contiguous()
    rows = slots.to(torch.int64).contiguous()
    new = fresh.to(torch.uint8).contiguous()
    channels, k = wf.shape
    state, state_rows = conv_state, rows
    if conv_state.dtype != torch.float32:      # the sequences' rows in float32, written back below
        state = conv_state.index_select(0, rows).float()
        state_rows = torch.arange(rows.shape[0], dtype=torch.int64)
    out = torch.empty(x.shape[0], channels, dtype=torch.float32)
    _function()(xf.data_ptr(), xf.stride(0), wf.data_ptr(), channels, k, state.data_ptr(), cu.data_ptr(),
                rows.shape[0], state_rows.data_ptr(), new.data_ptr(), out.data_ptr(),
                team_threads(x.shape[0], _PART_TOKENS), _PART_TOKENS)
    if state is not conv_state:
        conv_state.index_copy_(0, rows, state.to(conv_state.dtype))
    return out.to(x.dtype)
