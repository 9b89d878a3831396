"""Greedy sampling's argmax through ``argmax.cpp`` (float32 rows, eager): ``argmax`` returns None
where the input is not its case (not a 2-D float32 CPU tensor with a unit inner stride, an empty
row, inside a compiled graph, the kernel unavailable), and the caller runs ``torch.argmax``."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import load, why_unavailable

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=1)
def _function():
    fn = load("argmax", row_gemm.ARCH_FLAGS).argmax_rows_f32
    fn.argtypes, fn.restype = [_P, _I, _I, _I, _P], None
    return fn


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can): row_gemm's CPU needs, and its own build."""
    return why_unavailable(row_gemm.cpu_unavailable(), _function)


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """``logits.argmax(dim=-1)`` of float32 logits [B, V]: the first index of each row's maximum
    (of its first NaN where there is one)."""
    if (logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.shape[1] == 0 or logits.stride(1) != 1 or torch.compiler.is_compiling() or unavailable()):
        return None
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0]:
        _function()(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr())
    return out
