"""RMSNorm and rotate-half RoPE through ``norm_rope.cpp`` (float32 or bfloat16, eager; bf16
rounds where torch's bf16 formulas round). Each function returns None where the inputs are not
its case (another dtype, mixed dtypes, a non-unit inner stride, inside a compiled graph, or the
kernel unavailable), and the caller runs its torch formula. A prefill's rows are split over
torch's OpenMP team (``parallel.h``), with the same numbers as one thread."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import OPENMP, load, why_unavailable
from .row_split import team_threads_by_values

_P, _I = ctypes.c_void_p, ctypes.c_int64


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.lru_cache(maxsize=None)
def _functions(dtype: torch.dtype = torch.float32):
    lib = load("norm_rope", row_gemm.ARCH_FLAGS + OPENMP)
    norm, rope = getattr(lib, f"rms_norm_{_SUFFIX[dtype]}"), getattr(lib, f"rope_half_{_SUFFIX[dtype]}")
    norm.argtypes, norm.restype = [_P, _I, _I, _I, _P, ctypes.c_float, _P, _I], None
    rope.argtypes, rope.restype = [_P, _I, _I, _I, _I, _I, _P, _P, _P, _I], None
    return norm, rope


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can): row_gemm's CPU needs, and its own build."""
    return why_unavailable(row_gemm.cpu_unavailable(), _functions)


def _eager(*tensors: torch.Tensor) -> bool:
    """One dtype the kernels take, on the CPU, last dim contiguous, eager, no autograd."""
    return (tensors[0].dtype in _SUFFIX
            and all(t.dtype == tensors[0].dtype and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
            and not torch.compiler.is_compiling() and not row_gemm.tracks_grad(*tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` for x [..., dim] (bf16: as ``norm.rms_norm``
    rounds, the normalised x then the product)."""
    if x.dim() < 1 or not _eager(x, weight) or weight.shape != x.shape[-1:] or unavailable():
        return None
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)        # a view where it can be (rows may be strided)
    out = torch.empty(x.shape, dtype=x.dtype)
    if rows.numel():
        _functions(x.dtype)[0](rows.data_ptr(), rows.shape[0], dim, rows.stride(0),
                               weight.contiguous().data_ptr(), eps, out.data_ptr(),
                               team_threads_by_values(rows.shape[0], dim))
    return out


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [N, heads, D] rotated by cos/sin [N, D] of x's dtype: ``x * cos + rotate_half(x) * sin``
    (bf16: each product and the sum rounded, as torch's bf16 ops round)."""
    if x.dim() != 3 or x.shape[-1] % 2 or not _eager(x, cos, sin) or unavailable():
        return None
    n, heads, d = x.shape
    if cos.shape != (n, d) or sin.shape != (n, d):
        return None
    cos, sin = cos.float().contiguous(), sin.float().contiguous()      # bf16 values widen exactly
    out = torch.empty(n, heads, d, dtype=x.dtype)
    if out.numel():
        _functions(x.dtype)[1](x.data_ptr(), n, heads, d, x.stride(0), x.stride(1), cos.data_ptr(),
                               sin.data_ptr(), out.data_ptr(), team_threads_by_values(n, heads * d))
    return out
