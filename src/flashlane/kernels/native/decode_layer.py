"""A whole llama decoder layer for decode rows in one native call: ``decode_layer.cpp`` for a
float32 model, ``decode_layer_bf16.cpp`` for a bfloat16 one (AMX linears, a bf16 pool). The cpu
backend's ``dense_decoder_layer`` uses it where every piece would take the native path anyway
(float32: linears native float32 or int8 with a native kernel, a float32 pool, up to
``row_gemm.MAX_ROWS`` rows; bf16: native bf16 linears the AMX kernel takes, a bf16 pool, up to
``row_gemm.AMX_MAX_ROWS`` rows; eager), and the model composes the separate ops otherwise."""

from __future__ import annotations

import ctypes
import functools

import torch

from ..gguf_blocks import BLOCK, BYTES, GROUP
from . import row_gemm
from .build import load, why_unavailable
from .simd_variants import VARIANT_FLAGS, Variants

_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Linear(ctypes.Structure):
    _fields_ = [("w", _P), ("scale", _P), ("bias", _P), ("kind", ctypes.c_int32)]


class _Weights(ctypes.Structure):
    _fields_ = [("ln1", _P), ("ln2", _P)] + [(n, _Linear) for n in ("q", "k", "v", "o", "gate", "up", "down")]


# how a linear multiplies: float32 weights, int8 weights widened (the int8 plan's "native"), int8
# weights and activations (its "w8a8-native"), GGUF blocks (``block_gemm``); the same kernels as
# the separate calls; "bf16": bf16 weights on AMX tiles, the bf16 layer's kind
KINDS = {"float32": 0, "int8": 1, "w8a8": 2, "q4_1": 3, "q8_0": 4, "bf16": 5}
_WEIGHT_DTYPE = {"float32": torch.float32, "int8": torch.int8, "w8a8": torch.int8, "q4_1": torch.uint8,
                 "q8_0": torch.uint8, "bf16": torch.bfloat16}
_ARGS = [_P, _I, _I, _I, ctypes.POINTER(_Weights), ctypes.c_float, _I, _I, _I, _P, _P, _P, _I, _P, _P, _I,
         _P, _I, ctypes.c_float, _P]


@functools.lru_cache(maxsize=None)
def _variant_function(variant: str):
    """The float32 layer of the ``variant`` build (``simd_variants``: its linears round alike)."""
    fn = load("decode_layer", VARIANT_FLAGS[variant]).llama_decode_layer_f32
    fn.argtypes, fn.restype = _ARGS, None
    return fn


_VARIANTS = Variants(_variant_function)


def _function():
    return _variant_function(_VARIANTS.best())


@functools.lru_cache(maxsize=1)
def _bf16_function():
    fn = load("decode_layer_bf16", row_gemm.AMX_FLAGS).llama_decode_layer_bf16
    fn.argtypes, fn.restype = _ARGS, None
    return fn


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the float32 kernel cannot run here (None: it can)."""
    return _VARIANTS.unavailable()


@functools.lru_cache(maxsize=1)
def bf16_unavailable() -> str | None:
    """Why the bf16 kernel cannot run here (None: it can): it needs the AMX linear."""
    return why_unavailable(row_gemm.amx_unavailable(), _bf16_function)


def _plain(t: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> bool:
    return t is None or (t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
                         and not row_gemm.tracks_grad(t))


class Linear:
    """One linear of the layer as the kernel takes it: ``kind`` (a ``KINDS`` key), the weight
    [out, in] (float32, int8 with float32 per-row ``scale``, or GGUF blocks repacked by 8 rows,
    uint8 [ceil(out / 8), in / 32 * 8 * bytes], with ``out_features``) and an optional bias."""

    def __init__(self, kind: str, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, out_features: int | None = None):
        self.kind, self.weight, self.scale, self.bias = kind, weight, scale, bias
        self.ok = (kind in KINDS and _plain(weight, _WEIGHT_DTYPE[kind]) and _plain(bias)
                   and (kind not in ("int8", "w8a8") or (scale is not None and _plain(scale)))
                   and (kind not in BYTES or out_features is not None))
        blocks = kind in BYTES
        self.in_features = weight.shape[1] // (GROUP * BYTES[kind]) * BLOCK if blocks else weight.shape[1]
        self.out_features = out_features if blocks else weight.shape[0]

    def struct(self) -> _Linear:
        ptr = lambda t: None if t is None else t.data_ptr()   # noqa: E731
        return _Linear(self.weight.data_ptr(), ptr(self.scale), ptr(self.bias), KINDS[self.kind])


class LayerWeights:
    """One layer's tensors in the kernel's order (q, k, v, o, gate, up, down ``Linear``s), checked
    and addressed at construction, which is once per call: nothing is cached that a moved or
    replaced weight could leave stale. The norms' dtype says which kernel: float32 (linears of
    the float32 kinds) or bfloat16 (every linear "bf16", every K a multiple of the AMX depth)."""

    def __init__(self, ln1: torch.Tensor, ln2: torch.Tensor, eps: float, linears: list[Linear],
                 heads: int, kv_heads: int, head_dim: int):
        q, gate = linears[0], linears[4]
        self.dtype = ln1.dtype
        bf16 = self.dtype == torch.bfloat16
        kinds_fit = all((lin.kind == "bf16") == bf16 for lin in linears) and (
            not bf16 or all(lin.in_features % row_gemm.AMX_K == 0 for lin in linears))
        self.ok = (self.dtype in (torch.float32, torch.bfloat16) and _plain(ln1, self.dtype)
                   and _plain(ln2, self.dtype) and kinds_fit and all(lin.ok for lin in linears))
        self.tensors = (ln1, ln2, *linears)
        self.eps, self.heads, self.kv_heads, self.head_dim = eps, heads, kv_heads, head_dim
        self.hidden, self.intermediate = q.in_features, gate.out_features
        self.struct = _Weights(ln1.data_ptr(), ln2.data_ptr(), *(lin.struct() for lin in linears)) if self.ok else None


def decode_layer(h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor,
                 slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, page_size: int,
                 scale: float) -> torch.Tensor:
    """h [M, hidden] (one decode token per sequence, in ``w``'s dtype, as the pool) -> the layer's
    output [M, hidden]; writes the tokens' K|V at pool rows ``slots`` (int64) and attends over
    ``lens[m]`` tokens through ``tables[m]`` (int64, contiguous)."""
    m = h.shape[0]
    h, cos, sin = h.contiguous(), cos.float().contiguous(), sin.float().contiguous()   # bf16 values widen exactly
    slots = slots if slots.dtype == torch.int64 and slots.is_contiguous() else slots.to(torch.int64).contiguous()
    out = torch.empty_like(h)
    if w.dtype == torch.bfloat16 and bf16_unavailable() is not None:     # also asks for the AMX tile state
        raise RuntimeError(f"the bf16 decode layer cannot run here: {bf16_unavailable()}")
    fn = _bf16_function() if w.dtype == torch.bfloat16 else _function()
    fn(h.data_ptr(), m, w.hidden, w.intermediate, ctypes.byref(w.struct), w.eps, w.heads, w.kv_heads, w.head_dim,
       cos.data_ptr(), sin.data_ptr(), pool.data_ptr(), pool.stride(0), slots.data_ptr(), tables.data_ptr(),
       tables.stride(0), lens.data_ptr(), page_size, scale, out.data_ptr())
    return out
