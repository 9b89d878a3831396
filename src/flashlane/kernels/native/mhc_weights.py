"""mHC through ``mhc_weights.cpp``: the per-token weights (``kernels.mhc.hc_pre``'s sigmoid /
softmax / Sinkhorn part, ~120 torch ops on tensors of a few floats) and ``hc_post`` in one native
pass each. Each returns None where the inputs are not its case (another device or dtype, inside a
compiled graph, autograd recording, or the kernel unavailable) and the caller runs the torch
formulas."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import load, why_unavailable

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=1)
def _functions():
    lib = load("mhc_weights", row_gemm.ARCH_FLAGS)
    weights, post = lib.mhc_weights_f32, lib.mhc_post_f32
    weights.argtypes, weights.restype = [_P, _I, _I, _P, _P, ctypes.c_float, _I, _P, _P, _P], None
    post.argtypes, post.restype = [_P, _P, _P, _P, _I, _I, _I, _P], None
    return weights, post


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernels cannot run here (None: they can)."""
    return why_unavailable(row_gemm.cpu_unavailable(), _functions)


def _eager(*tensors: torch.Tensor) -> bool:
    return (all(t.device.type == "cpu" for t in tensors) and not torch.compiler.is_compiling()
            and not row_gemm.tracks_grad(*tensors) and unavailable() is None)


def mhc_weights(mixed: torch.Tensor, n: int, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
                iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """mixed [N, (2 + n) n] float32 -> (pre [N, n], post [N, n], comb [N, n, n]), or None."""
    if mixed.dim() != 2 or mixed.shape[1] != (2 + n) * n or iters < 1 or not _eager(mixed, base, scale):
        return None
    rows = mixed.float().contiguous()
    b, s = base.float().contiguous(), scale.float().contiguous()
    count = rows.shape[0]
    pre, post = torch.empty(count, n), torch.empty(count, n)
    comb = torch.empty(count, n, n)
    _functions()[0](rows.data_ptr(), count, n, b.data_ptr(), s.data_ptr(), hc_eps, iters, pre.data_ptr(),
                post.data_ptr(), comb.data_ptr())
    return pre, post, comb


def mhc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor | None:
    """``kernels.mhc.hc_post`` for float32 streams: y [N, H], streams [N, n, H], post [N, n],
    comb [N, n, n] -> ``post (outer) y + comb^T X`` [N, n, H], or None."""
    if (streams.dim() != 3 or streams.dtype != torch.float32 or y.dtype != torch.float32
            or y.shape != (streams.shape[0], streams.shape[2]) or post.shape != streams.shape[:2]
            or comb.shape != (*streams.shape[:2], streams.shape[1]) or not _eager(y, streams, post, comb)):
        return None
    count, n, h = streams.shape
    x, yc = streams.contiguous(), y.contiguous()
    p, c = post.float().contiguous(), comb.float().contiguous()
    out = torch.empty(count, n, h, dtype=torch.float32)
    _functions()[1](yc.data_ptr(), x.data_ptr(), p.data_ptr(), c.data_ptr(), count, n, h, out.data_ptr())
    return out
