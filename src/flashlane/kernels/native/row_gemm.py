"""``x @ W^T + b`` for up to ``MAX_ROWS`` rows of float32 x through ``row_gemm.cpp`` (AVX2 + FMA),
on the weight as loaded. Faster than torch's sgemm where the rows are few (decode) and
batch-invariant; more rows go to torch. Single-threaded: the linear plan only picks it where a
start-up timing at the engine's thread count finds it faster."""

from __future__ import annotations

import ctypes
import functools

import torch

from ..cpu_caps import detect_cpu_caps
from .build import load, why_unavailable

MAX_ROWS = 16          # measured: ahead of MKL up to 16 rows, behind it at 32 (fp32, Zen 3, 1 thread)
ARCH_FLAGS = ("-mavx2", "-mfma")
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]


def cpu_unavailable() -> str | None:
    """Why this CPU cannot run the native kernels (AVX2 + FMA builds); None: it can."""
    caps = detect_cpu_caps()
    if caps.flags:
        missing = [f for f in ("avx2", "fma") if f not in caps.flags]
        if missing:
            return f"the CPU lacks {' and '.join(missing)}"
    elif caps.capability.upper() not in ("AVX2", "AVX512", "AMX"):
        return f"torch reports CPU capability {caps.capability}, not AVX2"
    return None


def unavailable() -> str | None:
    """Why the kernel cannot run on this machine (None: it can)."""
    return why_unavailable(cpu_unavailable(), _function)


@functools.lru_cache(maxsize=1)
def _function():
    fn = load("row_gemm", ARCH_FLAGS).row_gemm_f32
    fn.argtypes, fn.restype = _ARGS, None
    return fn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias; the native kernel for float32 CPU tensors of up to
    ``MAX_ROWS`` rows, torch's linear otherwise."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or rows > MAX_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != "cpu" or x.requires_grad or weight.requires_grad
            or (bias is not None and (bias.dtype != torch.float32 or bias.requires_grad))):
        return torch.nn.functional.linear(x, weight, bias)
    n, k = weight.shape
    a = x.reshape(rows, k)
    if a.stride(-1) != 1:
        a = a.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    b = None if bias is None else bias.contiguous()
    out = torch.empty(rows, n, dtype=torch.float32)
    _function()(a.data_ptr(), rows, a.stride(0), w.data_ptr(), n, k, w.stride(0),
                None if b is None else b.data_ptr(), out.data_ptr(), n)
    return out.reshape(*x.shape[:-1], n)
