"""KDA (Kimi Delta Attention) token mixer of glm5_next over flattened mixed batches.

Per-sequence state lives in the layer's state-pool row at ``batch.state_slots[b]``: the conv
state (last K-1 pre-conv inputs, model dtype) and the recurrent state ([H, Dk, Dv] fp32,
[K, V] orientation). The kernel backend (``batch.ops``) runs the conv and the recurrence of every
sequence from its slot's state and leaves the final state there, so the state flows across
prefill chunks; a sequence at position 0 ignores whatever its slot holds.
Parameter names follow the transformers in-memory state_dict (glm5-architecture §3.1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.backends import KernelBackend, select_backend
from .forward_batch import ForwardBatch


class KDAForgetGate(nn.Module):
    """Low-rank per-channel forget gate; produces the log-decay ``g`` [N, H, D] (fp32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        heads, dim = cfg.linear_num_heads, cfg.linear_head_dim
        self.lower_bound = cfg.linear_lower_bound
        self.f_a_proj = nn.Linear(cfg.hidden_size, dim, bias=False)
        self.f_b_proj = nn.Linear(dim, heads * dim, bias=False)
        # FLA-style init: a decay rate of 1 under the lower-bound gate, dt in [1e-3, 1e-1] otherwise
        self.A_log = nn.Parameter(torch.zeros(heads) if self.lower_bound is not None
                                  else torch.empty(heads).uniform_(1.0, 16.0).log())
        dt = torch.empty(heads * dim).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: torch.Tensor, ops: KernelBackend | None = None) -> torch.Tensor:
        ops = select_backend(x.device) if ops is None else ops
        return ops.kda_gate(self.f_b_proj(self.f_a_proj(x)), self.dt_bias, self.A_log, self.lower_bound)


class GatedHeadNorm(nn.Module):
    """RMSNorm over each head's D values (weight shared by heads) times sigmoid(gate), all fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h * torch.sigmoid(gate.float())).to(x.dtype)


class KDAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        if cfg.linear_num_heads <= 0 or cfg.linear_head_dim <= 0 or cfg.conv_kernel < 2:
            raise ValueError(f"layer {layer_id}: KDA needs linear_num_heads, linear_head_dim > 0 and "
                             f"conv_kernel >= 2 (got {cfg.linear_num_heads}, {cfg.linear_head_dim}, "
                             f"{cfg.conv_kernel})")
        self.layer_id = layer_id
        self.heads, self.head_dim = cfg.linear_num_heads, cfg.linear_head_dim
        qkv = cfg.kda_qkv_dim
        hidden = cfg.hidden_size
        self.qkv_dim = qkv
        self.q_proj = nn.Linear(hidden, qkv, bias=False)
        self.k_proj = nn.Linear(hidden, qkv, bias=False)
        self.v_proj = nn.Linear(hidden, qkv, bias=False)
        self.conv1d = nn.Conv1d(3 * qkv, 3 * qkv, cfg.conv_kernel, groups=3 * qkv, bias=False)
        self.forget_gate = KDAForgetGate(cfg)
        self.b_proj = nn.Linear(hidden, self.heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, qkv, bias=False)
        self.o_norm = GatedHeadNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(qkv, hidden, bias=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [N, hidden] (normed block input) -> [N, hidden]; updates this layer's state slots."""
        batch.keep_input(self.layer_id, x)
        n = x.shape[0]
        out = self._advance_state(x, batch)
        gate = self.g_b_proj(self.g_a_proj(x)).view(n, self.heads, self.head_dim)
        return self.o_proj(self.o_norm(out, gate).reshape(n, self.qkv_dim))

    def _advance_state(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Conv + recurrence over the new tokens from each slot's state (left in the slot); the
        recurrence's output [N, H, Dv]."""
        cache, ops = batch.cache, batch.ops
        row = cache.spec.kda_row(self.layer_id)
        conv_state, rec_state = cache.layer("conv", row), cache.layer("recurrent", row)
        n = x.shape[0]
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed = ops.short_conv(mixed, self.conv1d.weight, conv_state, batch, steps=batch.step_states("conv", row))
        q, k, v = (t.view(n, self.heads, self.head_dim) for t in mixed.split(self.qkv_dim, dim=-1))
        g = self.forget_gate(x, ops)
        beta = torch.sigmoid(self.b_proj(x))
        return ops.kda(q, k, v, g, beta, rec_state, batch, steps=batch.step_states("recurrent", row))

    def replay_state(self, x: torch.Tensor, batch: ForwardBatch) -> None:
        """Advance the slots' conv and recurrent state over tokens whose layer input ``x`` was
        recorded (a speculative rollback), without the output projections."""
        self._advance_state(x, batch)


__all__ = ["KDAAttention", "KDAForgetGate", "GatedHeadNorm"]
