"""Mixture-of-experts: sigmoid router with correction bias and group limit, grouped expert dispatch.

Router (spec §1.9): choose experts by ``sigmoid(logits) + bias`` (bias only steers the choice),
weight them by the unbiased sigmoid scores, optionally renormalised, times the routed scaling.
Dispatch: token-expert pairs are sorted by expert and every active expert runs one matmul pair
over all its tokens; int8 experts (``grouped_experts_int8``) take the same path with an int8
matmul per active expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant_matmul import int8_linear


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """``SiLU(gate) * up``; with ``limit`` the gate is clamped from above, up to [-limit, limit]."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def route(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor | None, *,
          top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
          scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H], router_weight [E, H] -> (weights [N, top_k] fp32, expert ids [N, top_k] int64)."""
    n_exp = router_weight.shape[0]
    if n_exp % n_group:
        raise ValueError(f"n_routed_experts ({n_exp}) must be divisible by n_group ({n_group})")
    if not 0 < top_k <= n_exp:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {n_exp}]")
    scores = F.linear(x.float(), router_weight.float()).sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(-1, n_group, n_exp // n_group)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(n_exp // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor,
                    swiglu_limit: float | None = None, act=None) -> torch.Tensor:
    """Weighted sum of the chosen experts: x [N, H], weights/ids [N, k], gate_up [E, 2I, H]
    (gate rows first), down [E, H, I] -> [N, H] in x's dtype. ``act(gate, up, limit)``: the
    backend's SwiGLU (default ``swiglu``)."""
    if torch.compiler.is_compiling():
        return experts_fixed_shape(x, weights, ids, gate_up, down, swiglu_limit)
    act = act or swiglu

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(xs, gate_up[e]).chunk(2, dim=-1)
        return F.linear(act(gate, up, swiglu_limit), down[e])
    return _dispatch(x, weights, ids, gate_up.shape[0], expert)


def grouped_experts_int8(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         gate_up_q: torch.Tensor, gate_up_scale: torch.Tensor,
                         down_q: torch.Tensor, down_scale: torch.Tensor,
                         swiglu_limit: float | None = None, linear=None, act=None) -> torch.Tensor:
    """``grouped_experts`` on int8 experts: gate_up_q [E, 2I, H] / down_q [E, H, I] int8 with
    per-expert, per-row fp32 scales [E, 2I] / [E, H]; ``linear(x, q, scale)`` is the int8 matmul
    run for each active expert (default: the weight-only packed kernel); ``act`` as there."""
    if torch.compiler.is_compiling():
        return experts_fixed_shape(x, weights, ids, gate_up_q, down_q, swiglu_limit, gate_up_scale, down_scale)
    linear, act = linear or int8_linear, act or swiglu

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = linear(xs, gate_up_q[e], gate_up_scale[e]).chunk(2, dim=-1)
        return linear(act(gate, up, swiglu_limit), down_q[e], down_scale[e])
    return _dispatch(x, weights, ids, gate_up_q.shape[0], expert)


def _dispatch(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int, expert) -> torch.Tensor:
    """Sort token-expert pairs by expert, run ``expert(e, rows)`` once per active expert, and
    sum the weighted results back per token."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    xs = x[token]
    ys = x.new_empty(n * k, x.shape[1])
    at = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        ys[at:at + c] = expert(e, xs[at:at + c])
        at += c
    weighted = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, weighted)


def experts_fixed_shape(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, swiglu_limit: float | None = None,
                        gate_up_scale: torch.Tensor | None = None,
                        down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``grouped_experts`` without the host sync on per-expert counts, so a compiled step has no
    data-dependent shapes. With fewer (token, choice) pairs than experts each pair gathers its
    expert's weights (decode: only the chosen experts are read); otherwise every expert runs on
    every token and unchosen ones are weighted by zero (all experts are read once). int8
    experts (with their row scales) are multiplied in bf16, like the weight-only int8 kernels.
    """
    n, k = ids.shape
    num_experts = gate_up.shape[0]
    int8 = gate_up_scale is not None
    dtype = torch.bfloat16 if int8 else x.dtype
    xs = x.to(dtype)
    if n * k < num_experts:
        flat = ids.reshape(-1)
        h = torch.bmm(xs.repeat_interleave(k, 0)[:, None], gate_up[flat].to(dtype).transpose(1, 2))[:, 0]
        if int8:
            h = h * gate_up_scale[flat].to(dtype)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(swiglu(gate, up, swiglu_limit)[:, None], down[flat].to(dtype).transpose(1, 2))[:, 0]
        if int8:
            y = y * down_scale[flat].to(dtype)
        return (y.view(n, k, -1) * weights[..., None]).sum(1).to(x.dtype)
    h = torch.matmul(xs[None], gate_up.to(dtype).transpose(1, 2))                 # [E, N, 2I]
    if int8:
        h = h * gate_up_scale[:, None].to(dtype)
    gate, up = h.chunk(2, dim=-1)
    y = torch.matmul(swiglu(gate, up, swiglu_limit), down.to(dtype).transpose(1, 2))   # [E, N, H]
    if int8:
        y = y * down_scale[:, None].to(dtype)
    dense = torch.zeros(n, num_experts, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
    return (y * dense.t()[..., None]).sum(0).to(x.dtype)
