"""int8 matmuls: int8 weights with one fp32 scale per output row, in three kernels.

- ``int8_linear`` (weight-only): torch's packed int8 kernel ``_weight_int8pack_mm`` reads a
  quarter of fp32's weight bytes, the win at decode where the matmul is bound by weight reads.
  On CPU it is fast only with bf16 activations, so activations go through bf16; it slows down
  sharply with many rows; it needs in_features % 16 == 0 (``PACK_K_MULTIPLE``).
- ``int8_linear_dequant`` (weight-only): dequantise the weight to bf16/fp32 and run a dense
  matmul; the dequantisation is paid once per call, so it pays only for many rows.
- ``int8_linear_native`` (weight-only): flashlane's own AVX2 kernel (``native/row_gemm.cpp``)
  widens the int8 weights to float32 in registers and keeps float32 activations, for up to
  ``row_gemm.MAX_ROWS`` rows (decode; batch-invariant); more rows take ``dequant-fp32``. On CPUs
  without native bf16 the packed kernel's bf16 activations are emulated and slow, this is not.
- ``w8a8_linear_native`` (dynamic W8A8): the same kernel quantising each row of activations as
  ``w8a8_linear`` does and summing in int32 without VNNI (AVX2 byte products), equal to
  ``w8a8_linear`` bit for bit; more than ``row_gemm.MAX_ROWS`` rows take ``w8a8_linear``.
- ``w8a8_linear`` (dynamic W8A8): activations quantised per token (symmetric int8), an exact
  int8 x int8 -> int32 product (``torch._int_mm``, VNNI/AMX on CPU), then both scales.
  On CPU ``_int_mm`` takes any M, N, K >= 2 and the weight's transposed view (checked on torch 2.13);
  CUDA's wants M > 16 and K, N multiples of 8, so other devices use the reference instead.

Each has a plain-torch reference (``*_reference``) on dequantised weights for tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .native import row_gemm

# _weight_int8pack_mm on CPU (torch 2.13) needs in_features % 16 == 0: other widths read out of
# bounds (garbage or a segfault), so those weights take the dequantising kernel instead.
PACK_K_MULTIPLE = 16


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] float weight -> (int8 [..., out, in], fp32 scale [..., out]), symmetric per
    output row (for fused experts [E, out, in]: per expert, per row)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=-1) / 127.0).clamp_min(1e-12)
    q = torch.clamp(torch.round(w / scale[..., None]), -127, 127).to(torch.int8)
    return q.contiguous(), scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (qweight.float() * scale.float()[..., None]).to(dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] float -> (int8 [M, K], fp32 scale [M, 1]), symmetric per row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-12)
    return torch.clamp(torch.round(xf / scale), -127, 127).to(torch.int8), scale


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _finish(out: torch.Tensor, x: torch.Tensor, n_out: int, bias: torch.Tensor | None) -> torch.Tensor:
    out = out.to(x.dtype).reshape(*x.shape[:-1], n_out)
    return out if bias is None else out + bias


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T + bias`` for x [..., in], weight-only (packed kernel)."""
    if qweight.shape[1] % PACK_K_MULTIPLE:
        return int8_linear_dequant(x, qweight, scale, bias)
    flat = _flat(x).to(torch.bfloat16)
    if flat.device.type == "cpu":
        mm = _int8pack_mm_opaque if torch.compiler.is_compiling() else torch.ops.aten._weight_int8pack_mm
        out = mm(flat, qweight, scale.to(torch.bfloat16))
    else:
        out = (flat @ qweight.to(torch.bfloat16).t()) * scale.to(torch.bfloat16)
    return _finish(out, x, qweight.shape[0], bias)


@torch.library.custom_op("flashlane::weight_int8pack_mm", mutates_args=())
def _int8pack_mm_opaque(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The packed kernel as an op Inductor calls as it is (its own lowering of
    ``_weight_int8pack_mm`` fails on a symbolic row count in torch 2.13)."""
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scale)


@_int8pack_mm_opaque.register_fake
def _(x, qweight, scale):
    return x.new_empty(x.shape[0], qweight.shape[0])


def int8_linear_dequant(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The same product by a dense matmul in ``compute_dtype`` (int8 values are exact in bf16);
    the row scale is applied to the output, not the weight, so the weight cast is all it costs."""
    out = F.linear(_flat(x).to(compute_dtype), qweight.to(compute_dtype)) * scale.to(compute_dtype)
    return _finish(out, x, qweight.shape[0], bias)


def int8_linear_dequant_fp32(x, qweight, scale, bias=None):
    return int8_linear_dequant(x, qweight, scale, bias, torch.float32)


def int8_linear_native(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    return row_gemm.int8_linear(x, qweight, scale, bias, int8_linear_dequant_fp32)


def w8a8_linear_native(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    return row_gemm.int8_linear(x, qweight, scale, bias, w8a8_linear, activations="int8")


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic W8A8: per-token int8 activations times int8 weights, exact int32 accumulation."""
    if x.device.type != "cpu" or qweight.shape[1] < 2:   # CPU _int_mm returns garbage for K == 1
        return w8a8_linear_reference(x, qweight, scale, bias)
    xq, xs = quantize_per_token(_flat(x))
    acc = torch._int_mm(xq, qweight.t())
    return _finish(acc * xs * scale, x, qweight.shape[0], bias)


# ---- references (plain torch on dequantised weights) -----------------------------------------

def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 matmul of x with the dequantised weight (no activation rounding)."""
    out = _flat(x).float() @ dequantize_int8(qweight, scale).t()
    return _finish(out, x, qweight.shape[0], bias)


def w8a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 matmul of the per-token-dequantised activations with the dequantised weight."""
    xq, xs = quantize_per_token(_flat(x))
    out = (xq.double() * xs.double()) @ (qweight.double() * scale.double()[:, None]).t()
    return _finish(out, x, qweight.shape[0], bias)


KERNELS = {
    "int8pack": int8_linear,
    "dequant-bf16": int8_linear_dequant,
    "dequant-fp32": int8_linear_dequant_fp32,
    "native": int8_linear_native,
    "w8a8": w8a8_linear,
    "w8a8-native": w8a8_linear_native,
    "reference": int8_linear_reference,
}
