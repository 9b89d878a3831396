"""RMSNorm and rotate-half RoPE through ``norm_rope.cpp`` (float32, eager). Each function returns
None where the inputs are not its case (another dtype, a non-unit inner stride, inside a compiled
graph, or the kernel unavailable), and the caller runs its torch formula."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import load, why_unavailable

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=1)
def _functions():
    lib = load("norm_rope", row_gemm.ARCH_FLAGS)
    norm, rope = lib.rms_norm_f32, lib.rope_half_f32
    norm.argtypes, norm.restype = [_P, _I, _I, _I, _P, ctypes.c_float, _P], None
    rope.argtypes, rope.restype = [_P, _I, _I, _I, _I, _I, _P, _P, _P], None
    return norm, rope


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can): row_gemm's CPU needs, and its own build."""
    return why_unavailable(row_gemm.cpu_unavailable(), _functions)


def _eager_f32(*tensors: torch.Tensor) -> bool:
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
            and not torch.compiler.is_compiling() and not row_gemm.tracks_grad(*tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` for x [..., dim]."""
    if x.dim() < 1 or not _eager_f32(x, weight) or weight.shape != x.shape[-1:] or unavailable():
        return None
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)        # a view where it can be (rows may be strided)
    out = torch.empty(x.shape, dtype=torch.float32)
    if rows.numel():
        _functions()[0](rows.data_ptr(), rows.shape[0], dim, rows.stride(0), weight.contiguous().data_ptr(), eps,
                        out.data_ptr())
    return out


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [N, heads, D] rotated by cos/sin [N, D]: ``x * cos + rotate_half(x) * sin``."""
    if x.dim() != 3 or x.shape[-1] % 2 or not _eager_f32(x, cos, sin) or unavailable():
        return None
    n, heads, d = x.shape
    if cos.shape != (n, d) or sin.shape != (n, d):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(n, heads, d, dtype=torch.float32)
    if out.numel():
        _functions()[1](x.data_ptr(), n, heads, d, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                        out.data_ptr())
    return out
