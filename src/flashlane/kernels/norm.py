"""RMSNorm in plain torch (the reference path of the ``rms_norm`` backend op)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * normalise(x)``: normalised in fp32, cast back to x's dtype, then weighted."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
