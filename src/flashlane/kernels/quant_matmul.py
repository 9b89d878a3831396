"""Weight-only int8 matmul: int8 weights with one scale per output row.

Decode at small batch is bound by reading the weights; int8 halves the bytes of bf16 and
quarters those of fp32. On CPU, torch's packed int8 kernel (``_weight_int8pack_mm``) is fast
only with bf16 activations, so activations are cast to bf16 for the product and back after.
"""

from __future__ import annotations

import torch


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 [out, in], fp32 scale [out]), symmetric per row."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q.contiguous(), scale


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T + bias`` for x [..., in]."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if flat.device.type == "cpu":
        out = torch.ops.aten._weight_int8pack_mm(flat.to(torch.bfloat16), qweight, scale.to(torch.bfloat16))
    else:
        out = (flat.to(torch.bfloat16) @ qweight.to(torch.bfloat16).t()) * scale.to(torch.bfloat16)
    out = out.to(x.dtype).reshape(*shape[:-1], qweight.shape[0])
    return out if bias is None else out + bias
