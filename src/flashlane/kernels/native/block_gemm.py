"""``x @ W^T + b`` on weights kept in GGUF blocks (Q4_1, Q8_0; ``kernels.gguf_blocks``), repacked by
8 output rows (``gguf_blocks.repack``), through ``block_gemm.cpp`` (AVX2 + FMA + F16C), for any
number of float32 rows: activations quantised per block of 32, integer block dots.
Batch-invariant and single-threaded."""

from __future__ import annotations

import ctypes
import functools

import torch

from ..gguf_blocks import BLOCK, BYTES, GROUP
from . import row_gemm
from .build import load, why_unavailable

_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]


@functools.lru_cache(maxsize=None)
def _function(kind: str):
    fn = getattr(load("block_gemm", row_gemm.ARCH_FLAGS), f"block_gemm_{kind}")
    fn.argtypes, fn.restype = _ARGS, None
    return fn


def unavailable() -> str | None:
    """Why the kernels cannot run on this machine (None: they can)."""
    return why_unavailable(row_gemm.cpu_unavailable(), lambda: [_function(k) for k in BYTES])


def takes(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel runs ``x`` (else the caller's torch path)."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and blocks.device.type == "cpu"
            and x.shape[-1] % BLOCK == 0 and x.numel() > 0 and (bias is None or bias.dtype == torch.float32)
            and not row_gemm.tracks_grad(x, bias))


def block_linear(x: torch.Tensor, kind: str, packed: torch.Tensor, n: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 @ W^T + bias, W [n, K] in ``kind`` blocks repacked by 8 rows (uint8
    [ceil(n / 8), K / 32 * 8 * bytes], ``gguf_blocks.repack``)."""
    k = x.shape[-1]
    if packed.shape != (-(-n // GROUP), k // BLOCK * GROUP * BYTES[kind]) or packed.dtype != torch.uint8:
        raise ValueError(f"{kind}: packed blocks {packed.dtype} {list(packed.shape)} do not hold {n} x {k} weights")
    a = x.reshape(-1, k)
    a = a if a.stride(-1) == 1 else a.contiguous()
    w = packed if packed.is_contiguous() else packed.contiguous()
    b = None if bias is None else bias.contiguous()
    out = torch.empty(a.shape[0], n, dtype=torch.float32)
    _function(kind)(a.data_ptr(), a.shape[0], a.stride(0), w.data_ptr(), n, k,
                    None if b is None else b.data_ptr(), out.data_ptr(), n)
    return out.reshape(*x.shape[:-1], n)
