"""int8 quantisation of a loaded model (engine arg ``quantization``): every ``nn.Linear`` (the LM
head included), and the fused routed-expert tensors of the MoE layers, become int8 weights with
fp32 per-output-row scales (per expert, per row for the experts); an ``Int8Plan`` says which
int8 kernel runs at which row count (weight-only, or dynamic W8A8 for many rows). Embedding
tables become int8 with one scale per token row, which is also the head's per-output-row scale,
so a tied head and its embedding share one int8 table.

Left in float: norms, the router, and ``Fp32Linear`` layers, which the reference keeps in fp32
on purpose (the indexer's head weights steer a top-k selection).

The int8 matmuls run through the kernel backend given to ``quantize`` (the engine's; default: the
preferred one for the weights' device), held by each int8 module since a linear sees no batch.
Weight quantisation and the timed kernel plan are load-time work and use ``kernels.int8_plan``,
``kernels.cpu_caps`` and ``kernels.quant_matmul`` directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.backends import KernelBackend, select_backend
from ..kernels.cpu_caps import CpuCaps, detect_cpu_caps
from ..kernels.int8_plan import METHODS, Int8Plan, choose_plan
from ..kernels.quant_matmul import KERNELS, dequantize_int8, quantize_int8
from .layers import Experts, Fp32Linear

HEAD_NAME = "lm_head"
# one kernel for every row count instead of the timed choice: results that do not depend on the
# machine's timings or on how requests were batched (the tests pin it)
KERNEL_ENV = "FLASHLANE_INT8_KERNEL"


def pinned_plan(method: str) -> Int8Plan | None:
    name = os.environ.get(KERNEL_ENV)
    if not name:
        return None
    usable = sorted(set(KERNELS) - {"reference"})
    if name not in usable:
        raise ValueError(f"{KERNEL_ENV}={name!r}: choose one of {', '.join(usable)}")
    return Int8Plan(method, (name,) * 3, f"pinned by {KERNEL_ENV}")


class Int8Linear(nn.Module):
    """Drop-in for nn.Linear holding int8 weights and per-row scales."""

    def __init__(self, linear: nn.Linear, plan: Int8Plan | None = None, ops: KernelBackend | None = None):
        super().__init__()
        q, scale = quantize_int8(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.float_dtype = linear.weight.dtype
        self.plan = plan
        self.ops = select_backend(q.device) if ops is None else ops

    @property
    def weight(self) -> torch.Tensor:
        """The dequantised weight, for code that reads it directly (MLA's absorbed kv_b_proj)."""
        return dequantize_int8(self.qweight, self.scale, self.float_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.int8_linear(x, self.qweight, self.scale, self.bias, self.plan)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8Embedding(nn.Module):
    """Drop-in for nn.Embedding: int8 rows with one scale per row, dequantised on lookup."""

    def __init__(self, embedding: nn.Embedding, shared: Int8Linear | None = None):
        super().__init__()
        if shared is None:
            q, scale = quantize_int8(embedding.weight)
        else:                                  # a tied head: the same table, the same row scales
            q, scale = shared.qweight, shared.scale
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.num_embeddings, self.embedding_dim = q.shape
        self.float_dtype = embedding.weight.dtype

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale, self.float_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.qweight[ids].float() * self.scale[ids][..., None]).to(self.float_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8"


class Int8Experts(nn.Module):
    """Drop-in for ``layers.Experts``: int8 fused experts, scales per expert and output row."""

    def __init__(self, experts: Experts, plan: Int8Plan | None = None, ops: KernelBackend | None = None):
        super().__init__()
        for name in ("gate_up_proj", "down_proj"):
            q, scale = quantize_int8(getattr(experts, name))
            self.register_buffer(f"{name}_q", q)
            self.register_buffer(f"{name}_scale", scale)
        self.swiglu_limit = experts.swiglu_limit
        self.num_experts = experts.gate_up_proj.shape[0]
        self.plan = plan
        self.ops = select_backend(experts.gate_up_proj.device) if ops is None else ops

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                ops: KernelBackend | None = None) -> torch.Tensor:
        """``ops``: the batch's backend when the MoE passes it, else the one given at quantisation."""
        ops = self.ops if ops is None else ops
        return ops.moe_experts_int8(x, weights, ids, self.gate_up_proj_q, self.gate_up_proj_scale,
                                    self.down_proj_q, self.down_proj_scale, self.swiglu_limit, self.plan)


@dataclass
class QuantReport:
    method: str
    linears: int                 # nn.Linear modules made int8, the head included
    expert_layers: int           # fused expert modules made int8
    experts: int                 # routed experts across those layers
    head: bool                   # the LM head is int8
    embeddings: int              # embedding tables made int8 (a tied one shares the head's)
    bytes_before: int
    bytes_after: int
    plan: Int8Plan

    def describe(self) -> str:
        return (f"quantization {self.method}: {self.linears} linears (head {'int8' if self.head else 'float'}), "
                f"{self.experts} experts in {self.expert_layers} MoE layers, {self.embeddings} embedding "
                f"table{'s' if self.embeddings != 1 else ''}; weights "
                f"{self.bytes_before / 2**20:.1f} -> {self.bytes_after / 2**20:.1f} MiB; {self.plan.describe()}")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they are held now (int8 weights and their
    scales both count; a tensor shared by two modules, like a tied head, counts once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _targets(model: nn.Module, skip: tuple[str, ...]):
    for name, m in model.named_modules():
        if any(s in name for s in skip):
            continue
        if isinstance(m, nn.Linear) and not isinstance(m, Fp32Linear):
            yield name, m
        elif isinstance(m, Experts):
            yield name, m


def representative_shape(model: nn.Module, skip: tuple[str, ...] = ()) -> tuple[int, int]:
    """The (out, in) weight shape holding the most weight elements: what the kernel choice is timed on."""
    totals: dict[tuple[int, int], int] = {}
    for _, m in _targets(model, skip):
        mats = [m.weight] if isinstance(m, nn.Linear) else [m.gate_up_proj[0], m.down_proj[0]]
        reps = 1 if isinstance(m, nn.Linear) else m.gate_up_proj.shape[0]
        for w in mats:
            shape = tuple(w.shape)
            totals[shape] = totals.get(shape, 0) + w.numel() * reps
    if not totals:
        raise ValueError("quantization is set, but the model has no linear layers or experts to quantise")
    return max(totals, key=totals.get)


def quantize(model: nn.Module, method: str, *, plan: Int8Plan | None = None, caps: CpuCaps | None = None,
             device: str = "cpu", skip: tuple[str, ...] = (), ops: KernelBackend | None = None) -> QuantReport:
    """Quantise ``model`` in place with ``method`` ("int8" or "w8a8"); the kernel plan is chosen
    for this CPU (timed once) unless given; the int8 matmuls run through ``ops`` (default: the
    preferred backend for ``device``)."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    before = weight_bytes(model)
    plan = plan or pinned_plan(method)
    if plan is None:
        act_dtype = next((t.dtype for _, m in _targets(model, skip) for t in m.parameters()), torch.float32)
        plan = choose_plan(method, caps or detect_cpu_caps(), representative_shape(model, skip), device,
                           dtype=act_dtype)
    ops = select_backend(device) if ops is None else ops
    linears = expert_layers = experts = 0
    head = False
    embeddings = [(name, m) for name, m in model.named_modules()
                  if isinstance(m, nn.Embedding) and not any(s in name for s in skip)]
    by_weight: dict[int, Int8Linear] = {}      # float weight -> the Int8Linear made from it
    for name, m in list(_targets(model, skip)):
        if isinstance(m, Experts):
            new = Int8Experts(m, plan, ops)
            expert_layers += 1
            experts += new.num_experts
        else:
            new = Int8Linear(m, plan, ops)
            by_weight[id(m.weight)] = new
            linears += 1
            head = head or name.rpartition(".")[2] == HEAD_NAME
        _replace(model, name, new)
    for name, emb in embeddings:
        _replace(model, name, Int8Embedding(emb, shared=by_weight.get(id(emb.weight))))
    return QuantReport(method, linears, expert_layers, experts, head, len(embeddings), before,
                       weight_bytes(model), plan)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def quantize_model(model: nn.Module, method: str, skip: tuple[str, ...] = ()) -> int:
    """``quantize`` returning only how many linears it replaced (the older interface)."""
    return quantize(model, method, skip=skip).linears
