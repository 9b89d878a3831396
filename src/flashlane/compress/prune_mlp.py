"""Channel pruning of SwiGLU MLPs by activation-weighted magnitude.

Score of intermediate channel c of an MLP:  mean_x |h_c(x)| * ||W_down[:, c]||_2, where
h = SiLU(gate(x)) * up(x) is the activation entering ``down_proj`` and the mean runs over the
calibration tokens the MLP saw. A routed expert is scored on the tokens routed to it (one
without tokens falls back to the weight norm alone). The lowest channels are dropped with the
same count in every layer, so the config keeps single width fields:

  * llama and the dense layers of glm5_next / glm_moe_dsa: ``intermediate_size``;
  * MoE layers: ``moe_intermediate_size``, the width of every routed expert and, times
    ``n_shared_experts``, of the shared expert (the config format has no separate shared width,
    so shared and routed experts are pruned together).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models.layers import MLP, MoE


@dataclass
class ChannelCollector:
    """Forward pre-hooks on every MLP's ``down_proj``: sum of |activation| per channel, and tokens."""

    act_sum: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def attach(self, model) -> list:
        return [m.down_proj.register_forward_pre_hook(self._hook(name))
                for name, m in model.named_modules() if isinstance(m, MLP)]

    def _hook(self, name: str):
        def hook(module, args) -> None:
            h = args[0].float().abs()
            self.act_sum[name] = self.act_sum.get(name, 0) + h.sum(0)
            self.tokens[name] = self.tokens.get(name, 0) + h.shape[0]
        return hook

    def mean_act(self, name: str) -> torch.Tensor:
        if name not in self.act_sum:
            raise ValueError(f"calibration never reached MLP {name}")
        return self.act_sum[name] / max(self.tokens[name], 1)


def channels_to_keep(fraction: float, width: int) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(f"--mlp-keep must be a fraction in (0, 1], got {fraction}")
    keep = round(fraction * width)
    if keep < 1:
        raise ValueError(f"--mlp-keep {fraction} keeps no channel of an MLP {width} channels wide")
    return keep


def top_channels(score: torch.Tensor, keep: int) -> torch.Tensor:
    """Ids (ascending) of the ``keep`` highest scores along the last dim (ties: the lower id)."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :keep].sort(dim=-1).values


def slice_mlp(state: dict[str, torch.Tensor], prefix: str, keep: torch.Tensor) -> None:
    for proj in ("gate_proj", "up_proj"):
        key = f"{prefix}.{proj}.weight"
        state[key] = state[key][keep].contiguous()
    key = f"{prefix}.down_proj.weight"
    state[key] = state[key][:, keep].contiguous()


def prune_dense(state, prefix: str, mean_act: torch.Tensor, keep: int) -> None:
    down = state[f"{prefix}.down_proj.weight"].float()
    slice_mlp(state, prefix, top_channels(mean_act * down.norm(dim=0), keep))


def prune_routed_channels(state, prefix: str, act_sum: torch.Tensor, tokens: torch.Tensor, keep: int) -> None:
    """Routed experts of MoE ``prefix``: per expert its own ``keep`` channels (act_sum [E, I])."""
    gate_up, down = state[f"{prefix}.experts.gate_up_proj"], state[f"{prefix}.experts.down_proj"]
    inter = gate_up.shape[1] // 2
    mean = torch.where(tokens[:, None] > 0, act_sum / tokens.clamp(min=1)[:, None], torch.ones_like(act_sum))
    ids = top_channels(mean * down.float().norm(dim=1), keep)                     # [E, keep]
    h = gate_up.shape[2]
    rows = torch.cat((ids, ids + inter), 1)[:, :, None].expand(-1, -1, h)
    state[f"{prefix}.experts.gate_up_proj"] = gate_up.gather(1, rows).contiguous()
    state[f"{prefix}.experts.down_proj"] = down.gather(2, ids[:, None, :].expand(-1, down.shape[1], -1)).contiguous()


def mlp_modules(model) -> tuple[list[str], list[str]]:
    """(dense MLP names, MoE names); shared experts are reached through their MoE."""
    moe = [n for n, m in model.named_modules() if isinstance(m, MoE)]
    shared = {f"{n}.shared_experts" for n in moe}
    dense = [n for n, m in model.named_modules() if isinstance(m, MLP) and n not in shared]
    return dense, moe
