"""The causal short convolution + SiLU of every sequence of a step (decode tokens and prefill
chunks) through ``short_conv.cpp``, from and into each sequence's conv state, in one call.
Returns None where the inputs are not its case (another device or state dtype, inside a compiled
graph, autograd recording, or the kernel unavailable) and the caller runs the torch kernels."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import load, why_unavailable

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=1)
def _function():
    fn = load("short_conv", row_gemm.ARCH_FLAGS).short_conv_f32
    fn.argtypes, fn.restype = [_P, _I, _P, _I, _I, _P, _P, _I, _P, _P, _P], None
    return fn


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return why_unavailable(row_gemm.cpu_unavailable(), _function)


def short_conv_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, cu_q: torch.Tensor,
                      slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor | None:
    """x [N, C]; weight [C, 1, K] or [C, K]; sequence b is rows cu_q[b]:cu_q[b+1] with its state in
    ``conv_state[slots[b]]`` ([S, C, K-1] float32, updated in place; ignored where ``fresh[b]``)
    -> SiLU(conv) [N, C] in x's dtype, or None."""
    w = weight.squeeze(1) if weight.dim() == 3 else weight
    if (conv_state.dtype != torch.float32 or conv_state.device.type != "cpu" or x.device.type != "cpu"
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
    out = torch.empty(x.shape[0], channels, dtype=torch.float32)
    _function()(xf.data_ptr(), xf.stride(0), wf.data_ptr(), channels, k, conv_state.data_ptr(), cu.data_ptr(),
                rows.shape[0], rows.data_ptr(), new.data_ptr(), out.data_ptr())
    return out.to(x.dtype)
