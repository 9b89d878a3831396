"""The per-token mHC weights (``kernels.mhc.hc_pre``'s sigmoid / softmax / Sinkhorn part) through
``mhc_weights.cpp``: one native pass instead of ~120 torch ops on tensors of a few floats. Returns
None where the inputs are not its case (another device, inside a compiled graph, autograd
recording, or the kernel unavailable) and the caller runs the torch formulas."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import load, why_unavailable

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=1)
def _function():
    fn = load("mhc_weights", row_gemm.ARCH_FLAGS).mhc_weights_f32
    fn.argtypes, fn.restype = [_P, _I, _I, _P, _P, ctypes.c_float, _I, _P, _P, _P], None
    return fn


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return why_unavailable(row_gemm.cpu_unavailable(), _function)


def mhc_weights(mixed: torch.Tensor, n: int, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
                iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """mixed [N, (2 + n) n] float32 -> (pre [N, n], post [N, n], comb [N, n, n]), or None."""
    if (mixed.device.type != "cpu" or mixed.dim() != 2 or mixed.shape[1] != (2 + n) * n or iters < 1
            or torch.compiler.is_compiling() or row_gemm.tracks_grad(mixed, base, scale) or unavailable()):
        return None
    rows = mixed.float().contiguous()
    b, s = base.float().contiguous(), scale.float().contiguous()
    count = rows.shape[0]
    pre, post = torch.empty(count, n), torch.empty(count, n)
    comb = torch.empty(count, n, n)
    _function()(rows.data_ptr(), count, n, b.data_ptr(), s.data_ptr(), hc_eps, iters, pre.data_ptr(),
                post.data_ptr(), comb.data_ptr())
    return pre, post, comb
