"""SwiGLU of a bfloat16 model through ``swiglu.cpp`` (eager, rows split over torch's OpenMP team).
``swiglu`` returns None where the inputs are not its case (not bf16, shapes or devices that
differ, a non-unit inner stride, inside a compiled graph, autograd, the kernel unavailable), and
the caller runs the torch formula.

Two builds of one source (``simd_variants``): ``avx512`` where the CPU has it, else ``avx2``."""

from __future__ import annotations

import ctypes
import functools

import torch

from . import row_gemm
from .build import OPENMP, load
from .row_split import team_threads_by_values
from .simd_variants import VARIANT_FLAGS, Variants
from .simd_variants import cpu_unavailable as cpu_unavailable   # re-exported: the variant's CPU needs

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=None)
def _function(variant: str):
    fn = load("swiglu", VARIANT_FLAGS[variant] + OPENMP).swiglu_bf16
    fn.argtypes, fn.restype = [_P, _I, _P, _I, _P, _I, ctypes.c_float, _I, _I], None
    return fn


_VARIANTS = Variants(_function)
unavailable, best_variant = _VARIANTS.unavailable, _VARIANTS.best


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None,
           variant: str | None = None) -> torch.Tensor | None:
    """``SiLU(gate) * up`` of bf16 gate / up [..., n] (with ``limit``: gate clamped from above and up
    to [-limit, limit] first), rounded as torch's bf16 ops round: ``moe.swiglu``'s result."""
    if (gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16 or gate.shape != up.shape or gate.dim() < 1
            or gate.device.type != "cpu" or up.device.type != "cpu" or gate.stride(-1) != 1 or up.stride(-1) != 1
            or (limit is not None and not limit >= 0) or torch.compiler.is_compiling()
            or row_gemm.tracks_grad(gate, up) or unavailable(variant)):
        return None
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)      # views where they can be (rows may be strided)
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    rows = g.shape[0]
    if not out.numel():
        return out
    _function(variant or best_variant())(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(), n,
                                         -1.0 if limit is None else limit, rows,
                                         team_threads_by_values(rows, n))
    return out
