"""Weight-only quantisation of a loaded model's linear layers (engine arg ``quantization``)."""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.quant_matmul import int8_linear, quantize_int8

METHODS = ("int8",)


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear holding int8 weights and per-row scales."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_int8(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.qweight, self.scale, self.bias)


def quantize_model(model: nn.Module, method: str, skip: tuple[str, ...] = ()) -> int:
    """Replace every nn.Linear (except names containing ``skip``) in place; returns how many."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(s in name for s in skip)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(linear))
    return len(targets)
