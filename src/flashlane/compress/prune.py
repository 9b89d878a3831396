"""Expert and channel pruning of a loaded flashlane model from one calibration pass."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..models.loader import is_mtp_name
from .calibration import forward_logits
from .checkpoint import text_fields, trunk_state, without_mtp
from .prune_experts import ExpertCollector, experts_to_keep, select_experts, slice_experts
from .prune_mlp import ChannelCollector, channels_to_keep, mlp_modules, prune_dense, prune_routed_channels

CALIBRATION_BATCH = 4  # windows per forward


@dataclass(frozen=True)
class PrunePlan:
    experts: int | None          # routed experts kept per MoE layer
    dense_channels: int | None   # intermediate_size after pruning
    expert_channels: int | None  # moe_intermediate_size after pruning

    def summary(self, cfg) -> list[str]:
        out = []
        if self.experts is not None:
            out.append(f"routed experts per MoE layer: {cfg.n_routed_experts} -> {self.experts}")
        if self.dense_channels is not None:
            out.append(f"intermediate_size: {cfg.intermediate_size} -> {self.dense_channels}")
        if self.expert_channels is not None:
            out.append(f"moe_intermediate_size: {cfg.moe_intermediate_size} -> {self.expert_channels}")
        return out


def plan_pruning(model, cfg, experts_keep: str | None, mlp_keep: float | None) -> PrunePlan:
    """Check the flags against the model before any work is done."""
    if experts_keep is None and mlp_keep is None:
        raise ValueError("nothing to prune: give --experts-keep and/or --mlp-keep")
    experts = None
    if experts_keep is not None:
        experts = experts_to_keep(str(experts_keep), cfg.n_routed_experts, cfg.num_experts_per_tok,
                                  cfg.n_group, cfg.topk_group)
    dense_ch = expert_ch = None
    if mlp_keep is not None:
        dense, moe = _trunk(mlp_modules(model), cfg)
        if not dense and not moe:
            raise ValueError("--mlp-keep: the model has no MLP to prune")
        dense_ch = channels_to_keep(mlp_keep, cfg.intermediate_size) if dense else None
        expert_ch = channels_to_keep(mlp_keep, cfg.moe_intermediate_size) if moe else None
    return PrunePlan(experts, dense_ch, expert_ch)


def _trunk(names: tuple[list[str], list[str]], cfg) -> tuple[list[str], list[str]]:
    return tuple([n for n in group if not is_mtp_name(n + ".", cfg)] for group in names)


def calibrate(model, cfg, windows: list[list[int]]) -> tuple[ExpertCollector, ChannelCollector]:
    experts, channels = ExpertCollector(), ChannelCollector()
    handles = experts.attach(model) + channels.attach(model)
    try:
        for i in range(0, len(windows), CALIBRATION_BATCH):
            forward_logits(model, cfg, windows[i:i + CALIBRATION_BATCH])
    finally:
        for h in handles:
            h.remove()
    return experts, channels


def prune_model(model, cfg, plan: PrunePlan, windows: list[list[int]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, HF config) of the pruned model; the MTP block is dropped (never calibrated)."""
    expert_stats, channel_stats = calibrate(model, cfg, windows)
    state = dict(trunk_state(model, cfg))
    dense, moe = _trunk(mlp_modules(model), cfg)
    for name in moe:
        st = expert_stats.stats.get(name)
        if st is None:
            raise ValueError(f"calibration never reached MoE layer {name}")
        act_sum, tokens = st.act_sum, st.tokens
        if plan.experts is not None:
            ids = select_experts(st.saliency(), plan.experts, max(cfg.n_group, 1))
            slice_experts(state, name, ids)
            act_sum, tokens = act_sum[ids], tokens[ids]
        if plan.expert_channels is not None:
            prune_routed_channels(state, name, act_sum, tokens, plan.expert_channels)
            if f"{name}.shared_experts.down_proj.weight" in state:
                shared = f"{name}.shared_experts"
                prune_dense(state, shared, channel_stats.mean_act(shared), plan.expert_channels * cfg.n_shared_experts)
    if plan.dense_channels is not None:
        for name in dense:
            prune_dense(state, name, channel_stats.mean_act(name), plan.dense_channels)
    config = without_mtp(copy.deepcopy(cfg.raw))
    text = text_fields(config)
    if plan.experts is not None:
        text["n_routed_experts"] = plan.experts
    if plan.dense_channels is not None:
        text["intermediate_size"] = plan.dense_channels
    if plan.expert_channels is not None:
        text["moe_intermediate_size"] = plan.expert_channels
    return state, config
