"""REAP-style routed-expert pruning of ``glm5_next`` / ``glm_moe_dsa`` MoE layers.

Saliency of expert j in a layer, measured on the calibration tokens with the model's own router:

    S_j = (1 / |X_j|) * sum_{x in X_j} g_j(x) * ||f_j(x)||_2

where X_j are the tokens whose top-k choice includes j, g_j(x) is the gate weight the layer
multiplies expert j's output by (after top-k normalisation and ``routed_scaling_factor``) and
f_j(x) is expert j's SwiGLU output for x. An expert that no calibration token reaches has S_j = 0.
Each layer keeps the same number of experts (``n_routed_experts`` is one config value); with
group-limited routing (``n_group`` > 1) every group keeps the same number, so the contiguous
group slices the router relies on stay intact. The router rows and ``e_score_correction_bias``
of the dropped experts go with them; kept experts keep their order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..kernels.moe import swiglu
from ..models.layers import MoE


@dataclass
class ExpertStats:
    """Per-layer sums over calibration tokens (indexed by the expert's original id)."""

    saliency_sum: torch.Tensor    # [E] sum of g_j(x) * ||f_j(x)||
    tokens: torch.Tensor          # [E] |X_j|
    act_sum: torch.Tensor         # [E, I] sum of |SwiGLU activation| per channel (for channel pruning)

    def saliency(self) -> torch.Tensor:
        return self.saliency_sum / self.tokens.clamp(min=1)


@dataclass
class ExpertCollector:
    """Forward hooks on every MoE module that accumulate ``ExpertStats`` by module name."""

    stats: dict[str, ExpertStats] = field(default_factory=dict)

    def attach(self, model) -> list:
        return [m.register_forward_hook(self._hook(name)) for name, m in model.named_modules() if isinstance(m, MoE)]

    def _hook(self, name: str):
        def hook(module: MoE, args, output) -> None:
            x = args[0].float()
            weights, ids = module.gate(x)
            experts = module.experts
            gate_up, down = experts.gate_up_proj.float(), experts.down_proj.float()
            n_exp, inter = gate_up.shape[0], gate_up.shape[1] // 2
            st = self.stats.get(name) or ExpertStats(torch.zeros(n_exp), torch.zeros(n_exp), torch.zeros(n_exp, inter))
            self.stats[name] = st
            for e in ids.unique().tolist():
                rows, slot = (ids == e).nonzero(as_tuple=True)
                gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
                h = swiglu(gate, up, experts.swiglu_limit)
                out = F.linear(h, down[e])
                st.saliency_sum[e] += (weights[rows, slot] * out.norm(dim=-1)).sum()
                st.tokens[e] += len(rows)
                st.act_sum[e] += h.abs().sum(0)
        return hook


def experts_to_keep(spec: str, n_experts: int, top_k: int, n_group: int, topk_group: int) -> int:
    """``--experts-keep`` (a count like ``12`` or a fraction like ``0.5``) -> experts kept per layer."""
    if n_experts <= 0:
        raise ValueError("--experts-keep: the model has no routed experts (only glm5_next / glm_moe_dsa MoE "
                         "layers can be expert-pruned; use --mlp-keep for dense MLPs)")
    try:
        value = float(spec)
    except ValueError:
        raise ValueError(f"--experts-keep must be a count or a fraction in (0, 1], got {spec!r}") from None
    if "." in str(spec) or "e" in str(spec).lower():
        if not 0 < value <= 1:
            raise ValueError(f"--experts-keep fraction must be in (0, 1], got {spec}")
        keep = round(value * n_experts)
    else:
        keep = int(value)
    if not 1 <= keep <= n_experts:
        raise ValueError(f"--experts-keep {spec} keeps {keep} of {n_experts} experts per layer; "
                         f"it must keep between 1 and {n_experts}")
    if keep < top_k:
        raise ValueError(f"--experts-keep {spec} keeps {keep} experts, fewer than num_experts_per_tok={top_k} "
                         "that every token is routed to")
    if n_group > 1 and keep % n_group:
        raise ValueError(f"--experts-keep {spec} keeps {keep} experts, not divisible by n_group={n_group} "
                         "(every routing group keeps the same number)")
    if n_group > 1 and topk_group < n_group and (keep // n_group) * topk_group < top_k:
        raise ValueError(f"--experts-keep {spec}: {topk_group} group(s) of {keep // n_group} experts cannot "
                         f"hold num_experts_per_tok={top_k}")
    return keep


def select_experts(saliency: torch.Tensor, keep: int, n_group: int = 1) -> torch.Tensor:
    """The ids (ascending) of the ``keep`` most salient experts, ``keep / n_group`` per group."""
    groups = saliency.view(n_group, -1)
    per = keep // n_group
    # stable: among equal saliencies the lower id wins
    order = torch.sort(groups, dim=-1, descending=True, stable=True).indices[:, :per]
    ids = order + torch.arange(n_group)[:, None] * groups.shape[1]
    return ids.reshape(-1).sort().values


def slice_experts(state: dict[str, torch.Tensor], prefix: str, keep_ids: torch.Tensor) -> None:
    """Keep only ``keep_ids`` in the router and fused expert tensors of MoE module ``prefix``."""
    for name in ("gate.weight", "gate.e_score_correction_bias", "experts.gate_up_proj", "experts.down_proj"):
        key = f"{prefix}.{name}"
        if key in state:
            state[key] = state[key][keep_ids].contiguous()
