"""Shared building blocks: RMSNorm, (clamped) SwiGLU MLP, MoE with router and fused experts.

Parameter names follow the transformers in-memory ``state_dict`` of the reference models. The FFN
modules take the kernel backend as ``ops`` (the decoder layers pass ``batch.ops``); called on
their own they use the preferred backend for the input's device.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.backends import KernelBackend, select_backend
from ..trace_ranges import profiling_range


def _ops(ops: KernelBackend | None, x: torch.Tensor) -> KernelBackend:
    return select_backend(x.device) if ops is None else ops


class KeepFp32(nn.Module):
    """Keeps the tensors named in ``fp32_names`` in float32 through ``.to(dtype)`` / ``.half()``
    (the reference keeps router bias, indexer head weights and pool APE in fp32)."""

    fp32_names: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        saved = {}
        for name in self.fp32_names:
            store = self._parameters if name in self._parameters else self._buffers
            if store.get(name) is not None:
                # snapshot: parameters are usually converted in place
                saved[name] = (store, store[name].detach().clone())
        out = super()._apply(fn, recurse)
        for name, (store, orig) in saved.items():
            moved = store[name]
            if moved.dtype != torch.float32:
                data = orig.to(device=moved.device, dtype=torch.float32)
                if isinstance(moved, nn.Parameter):
                    moved.data = data
                else:
                    store[name] = data
        return out


class Fp32Linear(KeepFp32, nn.Linear):
    fp32_names = ("weight",)


class RMSNorm(nn.Module):
    """``w * normalise(x)``: normalised in fp32, cast back to the input dtype, then weighted."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: KernelBackend | None = None) -> torch.Tensor:
        return _ops(ops, x).rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU MLP; ``swiglu_limit`` switches on the clamped variant (glm5_next)."""

    range_name = "mlp"   # profiler range; an MoE's shared experts say "moe_shared"

    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, ops: KernelBackend | None = None) -> torch.Tensor:
        with profiling_range(self.range_name):
            return self.down_proj(_ops(ops, x).swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))


class Router(KeepFp32):
    fp32_names = ("e_score_correction_bias",)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor, ops: KernelBackend | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _ops(ops, x).route(x, self.weight, self.e_score_correction_bias, top_k=self.top_k,
                                  n_group=self.n_group, topk_group=self.topk_group,
                                  norm_topk_prob=self.norm_topk_prob, scaling=self.scaling)


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))   # gate rows first, then up
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.swiglu_limit = cfg.swiglu_limit
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                ops: KernelBackend | None = None) -> torch.Tensor:
        return _ops(ops, x).moe_experts(x, weights, ids, self.gate_up_proj, self.down_proj, self.swiglu_limit)


class MoE(nn.Module):
    """Routed experts plus (optionally) shared experts of width ``moe_intermediate * n_shared``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.n_routed_experts <= 0 or cfg.num_experts_per_tok <= 0:
            raise ValueError("MoE needs n_routed_experts > 0 and num_experts_per_tok > 0")
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.swiglu_limit)
            if cfg.n_shared_experts > 0 else None
        )
        if self.shared_experts is not None:
            self.shared_experts.range_name = "moe_shared"

    def forward(self, x: torch.Tensor, ops: KernelBackend | None = None) -> torch.Tensor:
        ops = _ops(ops, x)
        with profiling_range("moe_router"):
            weights, ids = self.gate(x, ops)
        with profiling_range("moe_experts"):
            out = self.experts(x, weights, ids, ops)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, ops)
        return out


def call_layer(layer: nn.Module, x: torch.Tensor, batch, *extra):
    """How a model calls its decoder layers: ``layer(x, batch, *extra)``. A model's
    ``forward(batch, layer_call=...)`` takes another caller of this signature instead (the
    static-graph decode passes one that runs each layer through a compiled region)."""
    return layer(x, batch, *extra)


def dense_or_moe(cfg: ModelConfig, layer: int) -> nn.Module:
    """The FFN of ``layer`` as the config's ``ffn_types`` says."""
    if cfg.ffn_types[layer] == "moe":
        return MoE(cfg)
    return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit)


__all__ = ["RMSNorm", "MLP", "MoE", "Router", "Experts", "KeepFp32", "Fp32Linear", "dense_or_moe",
           "call_layer"]
