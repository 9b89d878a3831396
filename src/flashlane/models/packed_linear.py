"""Float linears with their weights held in the format the kernel plan chose (engine arg
``linear_kernel``; ``kernels.linear_plan``): every plain ``nn.Linear`` of a loaded model becomes a
``PackedLinear`` (a reordered copy, ``onednn``) or a ``KernelLinear`` (the loaded weight kept as its
parameter, ``native``), multiplied through the kernel backend.

Left as they are: ``Fp32Linear`` layers (the reference keeps them in fp32 on purpose; they are
small) and anything already quantised. A tied LM head gets its own packed copy (the embedding
keeps the table it looks rows up in; ``native`` shares it); ``PackReport`` counts those bytes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.backends import KernelBackend
from ..kernels.linear_plan import LinearPlan, copies_weight, pack_weight, unpack_weight
from .layers import Fp32Linear


class PackedLinear(nn.Module):
    """Drop-in for nn.Linear whose weight lives in ``fmt``'s storage (not a parameter: an opaque
    layout that state_dict, ``.to()`` and weight fingerprints must not see)."""

    def __init__(self, linear: nn.Linear, fmt: str, ops: KernelBackend):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.fmt = fmt
        self.packed = pack_weight(fmt, linear.weight.detach())
        self.bias = linear.bias
        self.float_dtype = linear.weight.dtype
        self.ops = ops
        self._dense: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> "PackedLinear":
        # an opaque packed tensor has no storage to copy: pack a copy of the dense weight again
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = nn.Parameter(self.weight.detach().clone(), requires_grad=False)
        plain.bias = copy.deepcopy(self.bias, memo)
        return PackedLinear(plain, self.fmt, self.ops)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, for code that reads it directly (MLA's absorbed kv_b_proj): unpacked
        once and kept."""
        if self._dense is None:
            self._dense = unpack_weight(self.fmt, self.packed)
        return self._dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.dense_linear(x, self.packed, self.bias, self.fmt)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"


class KernelLinear(nn.Linear):
    """An ``nn.Linear`` multiplied through the kernel backend in a format that keeps the loaded
    weight (``native``): weight and bias stay the same parameters, so state_dict, ``.to()``, weight
    fingerprints and a tied embedding see them as before."""

    def __init__(self, linear: nn.Linear, fmt: str, ops: KernelBackend):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.fmt = fmt
        self.ops = ops

    def __deepcopy__(self, memo) -> "KernelLinear":
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        plain.weight = copy.deepcopy(self.weight, memo)
        plain.bias = copy.deepcopy(self.bias, memo)
        return KernelLinear(plain, self.fmt, self.ops)       # the backend object is shared, not copied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.dense_linear(x, self.weight, self.bias, self.fmt)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.fmt}"


@dataclass(frozen=True)
class PackReport:
    plan: LinearPlan
    linears: int                # nn.Linear layers now held in the plan's format
    extra_bytes: int            # packed copies of weights another module still holds (a tied head)

    def describe(self) -> str:
        if self.plan.format == "aten":
            return self.plan.describe()
        extra = f", +{self.extra_bytes / 2**20:.1f} MiB for tied weights" if self.extra_bytes else ""
        held = "packed" if copies_weight(self.plan.format) else "through it"
        return f"{self.plan.describe()}: {self.linears} linears {held}{extra}"

    def as_dict(self) -> dict:
        return {"format": self.plan.format, "why": self.plan.why, "linears": self.linears,
                "extra_bytes": self.extra_bytes}


def pack_linears(model: nn.Module, plan: LinearPlan, ops: KernelBackend) -> PackReport:
    """Replace every plain float ``nn.Linear`` of ``model`` by a ``PackedLinear`` in ``plan``'s
    format (in place; nothing changes for ``aten``)."""
    if plan.format == "aten":
        return PackReport(plan, 0, 0)
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and not isinstance(m, Fp32Linear) and m.weight.is_floating_point()]
    replaced = {id(m) for _, m in targets}
    kept = {id(p) for m in model.modules() if id(m) not in replaced for p in m.parameters(recurse=False)}
    extra = 0
    for name, m in targets:
        if id(m.weight) in kept and copies_weight(plan.format):   # a tied embedding keeps its own
            extra += m.weight.numel() * m.weight.element_size()
        parent, _, child = name.rpartition(".")
        held = PackedLinear if copies_weight(plan.format) else KernelLinear
        setattr(model.get_submodule(parent) if parent else model, child, held(m, plan.format, ops))
    return PackReport(plan, len(targets), extra)


__all__ = ["KernelLinear", "PackReport", "PackedLinear", "pack_linears"]
