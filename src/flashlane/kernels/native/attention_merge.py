"""Two attention results over disjoint key sets merged by their log-sum-exps in one native pass
(``attention_merge.cpp``): the prefill chunk after cached history attends the history and its
own keys in two flash calls (``backends/cpu/dense_attention``), and this joins them."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import load, why_unavailable

_P, _I = ctypes.c_void_p, ctypes.c_int64
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.lru_cache(maxsize=None)
def _function(dtype: torch.dtype = torch.float32):
    fn = getattr(load("attention_merge", row_gemm.ARCH_FLAGS), f"attention_merge_{_SUFFIX[dtype]}")
    fn.argtypes, fn.restype = [_P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _P], None
    return fn


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can)."""
    return why_unavailable(row_gemm.cpu_unavailable(), _function)


def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor | None:
    """o1, o2 [B, H, Q, D] (one dtype, float32 or bfloat16, the same strides, D contiguous) with
    their log-sum-exps l1, l2 [B, H, Q] (float32) -> the attention over both key sets, in o1's
    dtype and layout; None where the kernel does not take them (the caller merges in torch)."""
    if (o1.dtype not in _SUFFIX or o2.dtype != o1.dtype or o1.shape != o2.shape or o1.stride() != o2.stride()
            or o1.stride(-1) != 1 or l1.dtype != torch.float32 or l2.dtype != torch.float32
            or o1.device.type != "cpu" or torch.compiler.is_compiling() or row_gemm.tracks_grad(o1, o2)
            or unavailable() is not None):
        return None
    l1, l2 = l1.contiguous(), l2.contiguous()
    out = torch.empty_strided(o1.shape, o1.stride(), dtype=o1.dtype)
    strides = torch.tensor(o1.stride()[:3], dtype=torch.int64)
    b, h, q, d = o1.shape
    _function(o1.dtype)(o1.data_ptr(), o2.data_ptr(), strides.data_ptr(), l1.data_ptr(), l2.data_ptr(), b, h, q, d,
                        out.data_ptr(), strides.data_ptr())
    return out
