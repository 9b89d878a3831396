"""Engine arg ``quantization="gguf"``: the linears of a model loaded from a ``.gguf`` file keep the
file's own Q4_1 / Q8_0 blocks instead of the float32 weights dequantised from them, and multiply
through the kernel backend's ``block_linear`` with activations quantised per block of 32, as
llama.cpp runs the same file (``kernels.gguf_blocks``). A tied head keeps the embedding's blocks;
the embedding table itself stays float (a lookup reads one row). Tensors of other GGUF types stay
float32, as loaded.

Loading dequantised every weight already; each linear is matched to its blocks by name and the
blocks must dequantise to exactly the weight it holds, so a wrong name or row order is an error
here, not a silent change of the model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..kernels.backends import KernelBackend
from ..kernels.gguf_blocks import check_blocks, dequantize, repack, unrepack
from .layers import Fp32Linear


class GgufLinear(nn.Module):
    """Drop-in for nn.Linear holding a GGUF block tensor (the file's ``blocks`` [out, in / 32 *
    bytes], kept repacked by 8 rows as ``packed``: ``kernels.gguf_blocks.repack``)."""

    def __init__(self, linear: nn.Linear, kind: str, blocks: torch.Tensor, ops: KernelBackend):
        super().__init__()
        check_blocks(kind, blocks, linear.in_features)
        if blocks.shape[0] != linear.out_features:
            raise ValueError(f"{kind}: {blocks.shape[0]} block rows for {linear.out_features} outputs")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kind = kind
        self.register_buffer("packed", repack(kind, blocks))
        self.bias = linear.bias
        self.float_dtype = linear.weight.dtype
        self.ops = ops

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight, for code that reads it directly."""
        return dequantize(self.kind, unrepack(self.kind, self.packed, self.out_features), self.float_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.block_linear(x, self.kind, self.packed, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gguf {self.kind}"


@dataclass
class GgufReport:
    method: str                           # "gguf"
    kinds: Counter = field(default_factory=Counter)   # block kind -> linears kept in it
    head: str | None = None               # the head's block kind (None: float)
    float_linears: int = 0                # linears whose GGUF type has no block kernel (float32)
    bytes_before: int = 0
    bytes_after: int = 0
    kernel: str = ""

    @property
    def linears(self) -> int:
        return sum(self.kinds.values())

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {k.upper()}" for k, n in sorted(self.kinds.items()))
        return (f"quantization gguf: {self.linears} linears kept as the file's blocks ({kinds}; head "
                f"{self.head.upper() if self.head else 'float'}), {self.float_linears} float; activations "
                f"quantised per block of 32 (as llama.cpp); weights {self.bytes_before / 2**20:.1f} -> "
                f"{self.bytes_after / 2**20:.1f} MiB; {self.kernel}")

    def as_dict(self) -> dict:
        return {"method": self.method, "kinds": dict(self.kinds), "head": self.head,
                "float_linears": self.float_linears, "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after, "kernel": self.kernel}


def _tied_name(model: nn.Module, weight: torch.Tensor) -> str | None:
    """The name of another parameter that is ``weight`` (a tied head's embedding table)."""
    return next((n for n, p in model.named_parameters(remove_duplicate=False) if p is weight), None)


def keep_gguf_blocks(model: nn.Module, path: str | Path | None, ops: KernelBackend) -> GgufReport:
    """Replace the linears of ``model`` (loaded from the GGUF file ``path``) whose tensors the file
    stores in Q4_1 or Q8_0 by ``GgufLinear`` modules on those blocks (in place)."""
    from .gguf_loader import BLOCK_KINDS, gguf_blocks, gguf_config, open_gguf
    from .quantize import weight_bytes

    if path is None or Path(path).suffix != ".gguf" or not Path(path).is_file():
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks, but the model was not loaded from a "
                         f".gguf file (source: {path})")
    reader = open_gguf(path)
    blocks = gguf_blocks(reader, gguf_config(reader))
    report = GgufReport("gguf", bytes_before=weight_bytes(model))
    top = dict(model.named_modules())
    # what the model is: the CausalLM; its parameter names lack the registry's wrapper prefix
    for name, m in list(top.items()):
        if type(m) is not nn.Linear or isinstance(m, Fp32Linear):
            continue
        found = blocks.get(f"{name}.weight") or blocks.get(_tied_name(model, m.weight) or "")
        if found is None:
            report.float_linears += 1
            continue
        kind, raw = found
        if not torch.equal(dequantize(kind, raw, m.weight.dtype), m.weight.detach()):
            raise ValueError(f"quantization 'gguf': the {kind} blocks found for {name} do not dequantise to its "
                             f"loaded weight")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, GgufLinear(m, kind, raw, ops))
        report.kinds[kind] += 1
        if child == "lm_head":
            report.head = kind
    if not report.kinds:
        raise ValueError(f"quantization 'gguf': {path} stores no linear in a block type flashlane runs "
                         f"({', '.join(BLOCK_KINDS)})")
    report.bytes_after = weight_bytes(model)
    float32 = next(iter(model.parameters())).dtype == torch.float32
    native = getattr(ops, "native", False) and float32
    why = "" if float32 or not getattr(ops, "native", False) else "; the native kernels take a float32 model"
    report.kernel = (f"{ops.name} backend: " + ("native block kernels" if native
                                               else f"torch reference (both sides dequantised, one matmul{why})"))
    return report


__all__ = ["GgufLinear", "GgufReport", "keep_gguf_blocks"]
