"""The kernel backend seam: one interface per mixer and op kind, over the varlen batch metadata.

Model code calls ``batch.ops.<op>(...)`` and never imports a kernel by name; the backend decides
how an op runs: decode, mixed prefill/decode and the padded static batch are its branches, not
the model's. The ops take tensors plus the batch metadata (``VarlenBatch``) the engine already
builds -- cu_seqlens-style ``cu_q``, positions, per-sequence state slots, block tables -- the
shape that flash-linear-attention and FlashMLA-style kernels expect.

A backend is a subclass of ``KernelBackend`` registered by name (``kernels.backends``); the
plain-torch ``cpu`` backend is the reference every other one is tested against.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class VarlenBatch(Protocol):
    """What the ops read from the batch metadata (``models.forward_batch.ForwardBatch`` has it).

    Token ``j`` of sequence ``b`` is flat row ``cu_q[b] + j`` at position
    ``ctx_lens[b] - q_lens[b] + j``; its cache row is ``slot_mapping`` in every paged pool.
    ``static``: a padded decode batch (one token per row, no host lists: ``q_lens`` and
    ``ctx_lens`` are None), the shape a compiled step sees; with ``rows_per_seq > 1`` a padded
    verify batch (every sequence has that many new tokens, rows ``b * rows_per_seq + j``).
    """

    cu_q: torch.Tensor                 # [B + 1] int64
    q_lens: list[int] | None           # new tokens per sequence (None when static)
    ctx_lens: list[int] | None         # cached + new tokens per sequence (None when static)
    ctx_lens_t: torch.Tensor           # [B] int64
    positions: torch.Tensor            # [N] int64
    seq_of_token: torch.Tensor         # [N] int64
    block_tables: torch.Tensor         # [B, max_pages] int64
    slot_mapping: torch.Tensor         # [N] int64
    state_slots: torch.Tensor          # [B] int64
    static: bool
    rows_per_seq: int                  # new tokens per sequence of a static batch

    @property
    def is_decode(self) -> bool: ...   # every sequence has exactly one new token

    @property
    def page_size(self) -> int: ...    # tokens per page of the paged pools


@dataclass(slots=True)       # built per layer and step: no frozen-dataclass setattr cost
class DenseDecoderLayer:
    """The parts of a pre-norm dense decoder layer (llama): RMSNorm -> GQA attention with
    rotate-half RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual, for a backend that runs the
    whole layer at once (``KernelBackend.dense_decoder_layer``). The linears are the model's own
    modules as loading left them: float ones carry their linear-plan format as ``fmt``, int8 ones
    (``models.quantize``) their ``qweight``, ``scale`` and int8 kernel ``plan``."""

    input_norm_weight: torch.Tensor
    post_norm_weight: torch.Tensor
    eps: float
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int


class KernelBackend(ABC):
    """One implementation of every op the models run. Subclass it (or ``CpuBackend``, overriding
    only the ops a device does better) and register it in ``kernels.backends``."""

    name: str = "base"

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    @abstractmethod
    def describe(self) -> str:
        """One line for the start-up report: which kernels run the ops."""

    # ---- dense attention (llama) ---------------------------------------------------------

    @abstractmethod
    def plan_attention(self, meta: VarlenBatch) -> Any:
        """Whatever ``dense_attention`` needs per forward (gather indices, masks), built once per
        forward and shared by all layers."""

    @abstractmethod
    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
                        pool_scale: torch.Tensor | None, meta: VarlenBatch, plan: Any) -> torch.Tensor:
        """Causal GQA attention over each sequence's paged history: writes the new tokens'
        ``[K | V]`` rows (k, v [N, Hkv, D]) into ``pool`` at ``meta.slot_mapping``, then attends
        q [N, Hq, D] -> [N, Hq, D]."""

    def dense_decoder_layer(self, layer: DenseDecoderLayer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            pool: torch.Tensor, pool_scale: torch.Tensor | None, meta: VarlenBatch,
                            plan: Any) -> torch.Tensor | None:
        """The whole of ``layer`` on the residual stream h [N, hidden] in one go, writing the new
        tokens' ``[K | V]`` as ``dense_attention`` does; None where this backend has no such path
        for this batch (the model then composes the separate ops, the reference)."""
        return None

    # ---- KDA linear attention -----------------------------------------------------------------

    @abstractmethod
    def kda_gate(self, f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
                 lower_bound: float | None) -> torch.Tensor:
        """Per-channel log-decay g [N, H, D] (fp32) from the low-rank gate output f [N, H*D]."""

    # ``steps`` (conv, KDA, the indexer's tail ring), only on a static verify batch: a buffer
    # [>= B, rows_per_seq - 1, *state] where each sequence's state after each of its tokens but
    # the last is written too, so a speculative rollback copies the accepted one back
    # (``engine.cache.snapshots.StepStates``); None: nothing kept.

    @abstractmethod
    def short_conv(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                   meta: VarlenBatch, steps: torch.Tensor | None = None) -> torch.Tensor:
        """Causal depthwise conv + SiLU of x [N, C] per sequence, from and into the conv state of
        its slot (a sequence at position 0 ignores what its slot holds)."""

    @abstractmethod
    def kda(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            rec_state: torch.Tensor, meta: VarlenBatch, steps: torch.Tensor | None = None) -> torch.Tensor:
        """The KDA recurrence of every sequence (decode steps and prefill chunks), starting from and
        leaving its state in ``rec_state[state_slots[b]]``: q, k, g [N, H, Dk], v [N, H, Dv],
        beta [N, H] -> o [N, H, Dv]."""

    # ---- DSA: rope, latent rows, indexer, sparse MLA ----------------------------------------

    @abstractmethod
    def rope_cos_sin(self, positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (cos, sin) [N, dim // 2] of the interleaved rotary embedding at ``positions``."""

    @abstractmethod
    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Interleaved-pair RoPE of the last dim of x [N, ..., dim] (written de-interleaved)."""

    @abstractmethod
    def write_kv_rows(self, pool: torch.Tensor, scale: torch.Tensor | None, values: torch.Tensor,
                      meta: VarlenBatch) -> None:
        """Store the new tokens' rows values [N, W] at ``meta.slot_mapping`` in the pool's format."""

    @abstractmethod
    def write_index_keys(self, index_keys: torch.Tensor, keys: torch.Tensor, key_scale: torch.Tensor | None,
                         meta: VarlenBatch, *, kpool: int = 1, gates: torch.Tensor | None = None,
                         ape: torch.Tensor | None = None, tail: torch.Tensor | None = None,
                         steps: torch.Tensor | None = None) -> None:
        """Store the indexer keys [N, D] of the new tokens; with ``kpool > 1`` pooled per
        ``kpool`` positions (gates [N, D], ape [kpool, D]; partial pools wait in ``tail``)."""

    @abstractmethod
    def select_positions(self, q: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor,
                         key_scale: torch.Tensor | None, meta: VarlenBatch, *, topk: int, kpool: int,
                         always_select_tail: bool) -> torch.Tensor:
        """Absolute positions each query attends [N, width] int64 (-1 = empty), from indexer
        queries q [N, H, D] and head weights w [N, H]."""

    @abstractmethod
    def sparse_mla(self, q_nope: torch.Tensor, q_rope: torch.Tensor | None, latent: torch.Tensor,
                   latent_scale: torch.Tensor | None, selection: torch.Tensor, meta: VarlenBatch, *,
                   scale: float, w_kv: torch.Tensor) -> torch.Tensor:
        """MLA over the selected positions of the latent pool: q_nope [N, H, Dn] (+ q_rope
        [N, H, R]) with the kv up-projection w_kv [H, Dn + Dv, C] -> [N, H, Dv] (before o_proj);
        a query with nothing selected gets zeros. The backend picks the absorbed (latent-space)
        or the expanded (head-space) form per step."""

    # ---- per-token glue: norms, rotate-half RoPE ----------------------------------------------

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x^2, -1) + eps))``, normalised in fp32 and cast back to x's
        dtype before the weight (the reference's order)."""

    @abstractmethod
    def rope_rotate_half(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE (llama) of x [N, heads, D] by cos/sin [N, D] in x's dtype."""

    # ---- FFN: SwiGLU, router, experts, int8 linears -----------------------------------------

    @abstractmethod
    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        """SiLU(gate) * up; with ``limit`` gate clamped from above and up to [-limit, limit]."""

    @abstractmethod
    def route(self, x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor | None, *,
              top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        """MoE routing: x [N, H] -> (weights [N, top_k] fp32, expert ids [N, top_k] int64)."""

    @abstractmethod
    def moe_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
        """Weighted sum of the chosen experts' SwiGLU MLPs: gate_up [E, 2I, H], down [E, H, I]."""

    @abstractmethod
    def moe_experts_int8(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         gate_up_q: torch.Tensor, gate_up_scale: torch.Tensor, down_q: torch.Tensor,
                         down_scale: torch.Tensor, swiglu_limit: float | None, plan: Any = None) -> torch.Tensor:
        """``moe_experts`` on int8 experts with per-expert, per-row scales; ``plan`` (an int8 kernel
        plan, or None for the default kernel) picks the int8 matmul."""

    @abstractmethod
    def dense_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     fmt: str = "aten") -> torch.Tensor:
        """x @ W^T + bias with the float weight W held in storage format ``fmt`` (``kernels.linear_plan``:
        ``aten`` = as loaded, ``onednn`` = reordered once for oneDNN, ``native`` = as loaded, few
        rows through flashlane's own kernel)."""

    @abstractmethod
    def int8_linear(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None, plan: Any = None) -> torch.Tensor:
        """x @ (qweight * scale)^T + bias with int8 weights [out, in] and per-row scales [out]."""

    @abstractmethod
    def block_linear(self, x: torch.Tensor, kind: str, packed: torch.Tensor, out_features: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T + bias with W [out_features, in] kept in a GGUF file's blocks of 32 (``kind``
        "q4_1" or "q8_0"), repacked by 8 rows (``kernels.gguf_blocks.repack``), and the activations
        quantised per block of 32, as llama.cpp does (``kernels.gguf_blocks`` is the reference)."""

    # ---- mHC ----------------------------------------------------------------------------------

    @abstractmethod
    def mhc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                norm_eps: float, hc_eps: float, sinkhorn_iters: int,
                compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Collapse streams [N, n, H] into the sublayer input [N, H], plus (post [N, n], comb [N, n, n]).
        ``compiled``: the model asked for its compilable pieces to run compiled."""

    @abstractmethod
    def mhc_post(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
                 compiled: bool = False) -> torch.Tensor:
        """Expand the sublayer output y [N, H] back into the streams [N, n, H]."""

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling's pick: ``logits.argmax(dim=-1)`` of float32 logits [B, V] (the first
        index of each row's maximum)."""
        return logits.argmax(dim=-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={str(self.device)!r})"


__all__ = ["KernelBackend", "VarlenBatch"]
