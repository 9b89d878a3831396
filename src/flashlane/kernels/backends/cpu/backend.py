"""The plain-torch backend: every op is a ``flashlane.kernels`` function. The ops the models called
before the seam run the same kernels in the same order; sparse MLA prefill chunks may run in the
expanded form where the cost rule prefers it (``kernels.sparse_mla_expanded``)."""

from __future__ import annotations

import torch

from ... import gguf_blocks, indexer, kda, kv_store, linear_plan, mhc, moe, norm, quant_matmul, rope, short_conv, sparse_mla
from ...compiled import compiled as compiled_fn
from ...native import (argmax, attention_merge, block_gemm, decode_layer, index_scores, kda_recurrent,
                        mhc_weights, norm_rope, paged_attention, prefill_attention, prefill_attention_f32, row_gemm,
                        swiglu, top_pools)
from ...native import short_conv as short_conv_native
from ...sparse_mla_expanded import prefer_expanded, sparse_mla_expanded
from ..base import KernelBackend, VarlenBatch
from .dense_attention import AttentionPlan, dense_attention


def fresh_sequences(meta: VarlenBatch) -> torch.Tensor:
    """[B] bool: sequences whose first new token is at position 0 (their slot content is stale)."""
    return meta.ctx_lens_t == meta.cu_q[1:] - meta.cu_q[:-1]


def _kda_mixed(q, k, v, g, beta, rec_state, slots, fresh, meta: VarlenBatch) -> torch.Tensor:
    """Decode tokens as one batched recurrent step (the path of a pure decode step, so a decode
    token's numbers do not depend on the prefills beside it), all prefill chunks of the step in
    one varlen chunked call."""
    out = torch.empty_like(v)
    decode = [b for b, ql in enumerate(meta.q_lens) if ql == 1]
    if decode:
        seqs = torch.tensor(decode, dtype=torch.long, device=q.device)
        tok = meta.cu_q[seqs]
        out[tok] = kda.kda_decode(q[tok], k[tok], v[tok], g[tok], beta[tok], rec_state, slots[seqs], fresh[seqs])
    prefill = [b for b, ql in enumerate(meta.q_lens) if ql > 1]
    if prefill:
        cu = meta.cu_q.tolist()
        tok = torch.cat([torch.arange(cu[b], cu[b + 1], device=q.device) for b in prefill])
        lens = torch.tensor([meta.q_lens[b] for b in prefill], dtype=torch.long, device=q.device)
        cu_seqlens = torch.zeros(len(prefill) + 1, dtype=torch.long, device=q.device)
        cu_seqlens[1:] = lens.cumsum(0)
        seqs = torch.tensor(prefill, dtype=torch.long, device=q.device)
        rows = slots[seqs]
        init = rec_state.index_select(0, rows).float().masked_fill_(fresh[seqs].view(-1, 1, 1, 1), 0.0)
        o, final = kda.kda_chunk_varlen(q[tok], k[tok], v[tok], g[tok], beta[tok], cu_seqlens, init)
        out[tok] = o
        rec_state.index_copy_(0, rows, final.to(rec_state.dtype))
    return out


# the int8 plan's kernels the whole-layer path runs itself, as the layer kernel's linear kinds
_INT8_KINDS = {"native": "int8", "w8a8-native": "w8a8"}


def _native_linear(module, rows: int) -> decode_layer.Linear | None:
    """``module`` as the whole-layer kernel multiplies it: a linear whose plan format is native
    (float32 weights as loaded, or bf16 ones the AMX kernel takes), one on GGUF blocks, or an int8
    one whose plan picks a native kernel at ``rows`` rows; None for anything else (torch formats,
    other int8 kernels, bf16 weights without AMX)."""
    if getattr(module, "fmt", None) == "native":
        w, bias = module.weight, module.bias
        if w.dtype == torch.bfloat16 and w.shape[1] % row_gemm.AMX_K == 0 and row_gemm.amx_unavailable() is None:
            return decode_layer.Linear("bf16", w, None, None if bias is None else bias.float())
        return decode_layer.Linear("float32", w, None, bias) if w.dtype == torch.float32 else None
    kind = getattr(module, "kind", None)
    if kind in gguf_blocks.BYTES:              # GGUF blocks, repacked (models.gguf_blocks.GgufLinear)
        return decode_layer.Linear(kind, module.packed, None, module.bias, module.out_features)
    plan = getattr(module, "plan", None)
    if getattr(module, "qweight", None) is not None and plan is not None:
        kind = _INT8_KINDS.get(plan.kernel_for(rows))
        if kind is not None:
            return decode_layer.Linear(kind, module.qweight, module.scale, module.bias)
    return None


def _identity(module) -> tuple:
    """What ``_native_linear`` reads from ``module``, as identities and storage addresses, from the
    module's own dicts (an nn.Module attribute lookup costs about a microsecond): equal keys mean
    the same tensors at the same places, the same plan and format."""
    d = module.__dict__
    key = [id(module), d.get("fmt"), id(d.get("plan"))]
    for held in (d["_parameters"], d["_buffers"]):
        for t in held.values():
            if t is not None:
                key += (id(t), t.data_ptr())
    return tuple(key)


# whole-layer weight tables kept (see CpuBackend._layer_weights); a full table starts over
_LAYER_TABLES = 4096


class CpuBackend(KernelBackend):
    """Plain-torch kernels (``flashlane/kernels/*.py``). They run on any torch device; on CPU they
    are the fast path, elsewhere the reference."""

    name = "cpu"

    def __init__(self, device: torch.device | str = "cpu", native: bool | None = None):
        super().__init__(device)
        self._rope_tables: dict[tuple[int, float], rope.RopeCache] = {}
        # flashlane's native kernels (kernels/native) for eager work where they build on this
        # CPU: dense decode attention read from the paged pool in place, RMSNorm and rotate-half
        # RoPE (float32 and bfloat16), GGUF block linears, whole llama decode layers (float32, and
        # bf16 where the CPU has AMX), the merge of a prefill chunk's two attention parts; the KDA
        # recurrence, the short conv and mHC (float32 and bfloat16); the indexer's prefill scores
        # and top-k; bf16 SwiGLU; greedy sampling's argmax. The AMX kernels (bf16 layers, bf16
        # prefill attention) and the fp32 prefill attention are optional on top.
        # None: decided here, once.
        self._native_why_not = (paged_attention.unavailable() or attention_merge.unavailable()
                                or norm_rope.unavailable() or decode_layer.unavailable() or block_gemm.unavailable()
                                or mhc_weights.unavailable()
                                or kda_recurrent.unavailable() or short_conv_native.unavailable()
                                or top_pools.unavailable() or index_scores.unavailable() or swiglu.unavailable()
                                or argmax.unavailable()
                                if self.device.type == "cpu" else f"device {self.device}")
        if native is None:
            native = self._native_why_not is None
        elif native and self._native_why_not:
            raise ValueError(f"native kernels cannot run here: {self._native_why_not}")
        self.native = native
        self._index_kernels = indexer.SelectionKernels(index_scores.index_scores, top_pools.top_pools)
        self._layer_tables: dict[tuple, decode_layer.LayerWeights | None] = {}

    def describe(self) -> str:
        layers = "fp32, and bf16 on AMX" if decode_layer.bf16_unavailable() is None else "fp32"
        prefill = "; bf16 prefill attention on AMX tiles" if prefill_attention.unavailable() is None else ""
        if prefill_attention_f32.preferred():
            prefill += f"; fp32 prefill attention from the pages ({prefill_attention_f32.best_variant()})"
        kernels = ("native decode attention (paged, in place), RMSNorm and RoPE, GGUF block linears; whole "
                   f"llama decode layers in one call where their linears are native ({layers}); the KDA "
                   "recurrence and short conv (prefill and decode) and mHC in fp32 and bf16; the indexer's "
                   f"prefill scores ({index_scores.best_variant()}) and top-k{prefill}" if self.native
                   else f"torch SDPA decode attention ({self._native_why_not or 'native kernels off'})")
        return f"{self.name}: plain-torch kernels (flashlane.kernels) on {self.device}; {kernels}"

    # ---- dense attention ---------------------------------------------------------------------

    def plan_attention(self, meta):
        return AttentionPlan(meta)

    def dense_attention(self, q, k, v, pool, pool_scale, meta, plan):
        return dense_attention(q, k, v, pool, pool_scale, meta, plan, self.native)

    def dense_decoder_layer(self, layer, h, cos, sin, pool, pool_scale, meta, plan):
        # only where each separate op would take its native path anyway: decode rows only (one
        # attention group), few enough for the few-row linears, float32 activations and pool with
        # linears that are native float32 or int8 with a native kernel for this row count, or bf16
        # activations and pool with native bf16 linears on AMX
        if not self.native or meta.static or len(plan.groups) != 1 or not plan.groups[0].every_row:
            return None
        rows = h.shape[0]
        if (h.dtype not in (torch.float32, torch.bfloat16) or rows > row_gemm.max_rows(h.dtype)
                or (h.dtype == torch.bfloat16 and decode_layer.bf16_unavailable() is not None)
                or pool_scale is not None or pool.dtype != h.dtype or pool.stride(-1) != 1 or layer.head_dim % 8
                or torch.compiler.is_compiling()
                or row_gemm.tracks_grad(h)):
            return None
        w = self._layer_weights(layer, rows)
        if w is None:
            return None
        g = plan.groups[0]
        return decode_layer.decode_layer(h, w, cos, sin, pool, meta.slot_mapping, g.tables, g.lens, meta.page_size,
                                         layer.head_dim ** -0.5)

    def _layer_weights(self, layer, rows: int) -> decode_layer.LayerWeights | None:
        """The kernel's weight table for ``layer`` at ``rows`` rows (None: some linear has no native
        kind), built once per set of tensors: the key holds every tensor's identity and address, so
        a replaced or moved weight builds a new table, never reuses a stale pointer."""
        mods = (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj, layer.gate_proj, layer.up_proj,
                layer.down_proj)
        norms = (layer.input_norm_weight, layer.post_norm_weight)
        key = (rows, layer.eps, layer.num_heads, layer.num_kv_heads, layer.head_dim,
               id(norms[0]), norms[0].data_ptr(), id(norms[1]), norms[1].data_ptr(), *map(_identity, mods))
        if key in self._layer_tables:
            return self._layer_tables[key]
        linears = [_native_linear(m, rows) for m in mods]
        w = None
        if None not in linears:
            w = decode_layer.LayerWeights(*norms, layer.eps, linears, layer.num_heads, layer.num_kv_heads,
                                          layer.head_dim)
            w = w if w.ok else None
        if len(self._layer_tables) >= _LAYER_TABLES:
            self._layer_tables.clear()
        self._layer_tables[key] = w
        return w

    # ---- KDA -------------------------------------------------------------------------------------

    def kda_gate(self, f, dt_bias, A_log, lower_bound):
        return kda.kda_gate(f, dt_bias, A_log, lower_bound)

    def short_conv(self, x, weight, conv_state, meta, steps=None):
        if steps is not None:
            return short_conv.short_conv(x, weight, conv_state, meta.state_slots, meta.cu_q, fresh_sequences(meta),
                                         steps)
        if self.native:       # every sequence in one native call (prefill and decode)
            out = short_conv_native.short_conv_varlen(x, weight, conv_state, meta.cu_q, meta.state_slots,
                                                      fresh_sequences(meta))
            if out is not None:
                return out
        if meta.is_decode:
            return short_conv.short_conv_decode(x, weight, conv_state, meta.state_slots, fresh_sequences(meta))
        return short_conv.short_conv(x, weight, conv_state, meta.state_slots, meta.cu_q, fresh_sequences(meta))

    def kda(self, q, k, v, g, beta, rec_state, meta, steps=None):
        slots, fresh = meta.state_slots, fresh_sequences(meta)
        if steps is not None:
            return kda.kda_steps(q, k, v, g, beta, rec_state, slots, fresh, meta.rows_per_seq, steps)
        if self.native:       # every sequence token by token in one native call (prefill and decode)
            out = kda_recurrent.kda_varlen(q, k, v, g, beta, rec_state, meta.cu_q, slots, fresh)
            if out is not None:
                return out
        if meta.is_decode:     # every sequence steps once: one batched recurrent step, no gathers
            return kda.kda_decode(q, k, v, g, beta, rec_state, slots, fresh)
        if meta.static:        # a verify batch: every sequence steps rows_per_seq times
            return kda.kda_steps(q, k, v, g, beta, rec_state, slots, fresh, meta.rows_per_seq)
        return _kda_mixed(q, k, v, g, beta, rec_state, slots, fresh, meta)

    # ---- DSA -------------------------------------------------------------------------------------

    def rope_cos_sin(self, positions, dim, theta):
        if torch.compiler.is_compiling():
            # no lazily grown table inside a graph (it would be built and stored while tracing);
            # the same frequencies as RopeCache's, computed in the graph
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
            freqs = positions.float()[..., None] * inv_freq
            return freqs.cos(), freqs.sin()
        table = self._rope_tables.get((dim, theta))
        if table is None:
            table = self._rope_tables.setdefault((dim, theta), rope.RopeCache(dim, theta))
        return table.cos_sin(positions)

    def rope(self, x, cos, sin):
        return rope.apply_rope(x, cos, sin)

    def write_kv_rows(self, pool, scale, values, meta):
        kv_store.write_rows(pool, scale, meta.slot_mapping, values)

    def write_index_keys(self, index_keys, keys, key_scale, meta, *, kpool=1, gates=None, ape=None, tail=None,
                         steps=None):
        if kpool == 1:
            indexer.write_index_keys(index_keys, keys, slot_mapping=meta.slot_mapping, page_size=meta.page_size,
                                     key_scale=key_scale)
            return
        q_lens = meta.cu_q[1:] - meta.cu_q[:-1]
        indexer.write_index_keys(
            index_keys, keys, slot_mapping=meta.slot_mapping, page_size=meta.page_size, kpool=kpool, gates=gates,
            ape=ape, tail=tail, positions=meta.positions, seq_of_token=meta.seq_of_token,
            start_of_seq=meta.ctx_lens_t - q_lens, ctx_of_seq=meta.ctx_lens_t, block_tables=meta.block_tables,
            state_slots=meta.state_slots, key_scale=key_scale, tail_steps=steps)

    def select_positions(self, q, w, index_keys, key_scale, meta, *, topk, kpool, always_select_tail):
        if meta.static:        # each row on its own (a verify batch's rows: their sequence's table each)
            tables = meta.block_tables if meta.rows_per_seq == 1 else meta.block_tables[meta.seq_of_token]
            return indexer.select_positions_decode(
                q, w, index_keys, positions=meta.positions, block_tables=tables,
                page_size=meta.page_size, topk=topk, kpool=kpool, always_select_tail=always_select_tail,
                key_scale=key_scale)
        return indexer.select_positions(
            q, w, index_keys, positions=meta.positions, q_lens=meta.q_lens, ctx_lens=meta.ctx_lens,
            block_tables=meta.block_tables, page_size=meta.page_size, topk=topk, kpool=kpool,
            always_select_tail=always_select_tail, key_scale=key_scale,
            kernels=self._index_kernels if self.native else None)

    def sparse_mla(self, q_nope, q_rope, latent, latent_scale, selection, meta, *, scale, w_kv):
        spans = self._expanded_spans(q_nope, q_rope, selection, meta, w_kv)
        if not spans:
            return self._sparse_mla_absorbed(q_nope, q_rope, latent, latent_scale, selection, meta.seq_of_token,
                                             meta, scale, w_kv)
        out = sparse_mla_expanded(
            q_nope, q_rope, latent, selection, w_kv, spans=spans, block_tables=meta.block_tables,
            page_size=meta.page_size, scale=scale, latent_scale=latent_scale)
        inside = torch.zeros(q_nope.shape[0], dtype=torch.bool, device=q_nope.device)
        for a, e, _ in spans:
            inside[a:e] = True
        rest = (~inside).nonzero().flatten()   # decode tokens and the chunks the rule keeps absorbed
        if rest.numel():
            out[rest] = self._sparse_mla_absorbed(q_nope[rest], None if q_rope is None else q_rope[rest], latent,
                                                  latent_scale, selection[rest], meta.seq_of_token[rest], meta,
                                                  scale, w_kv)
        return out

    @staticmethod
    def _sparse_mla_absorbed(q_nope, q_rope, latent, latent_scale, selection, seq_of_token, meta: VarlenBatch,
                             scale: float, w_kv: torch.Tensor) -> torch.Tensor:
        """W_k folded into the queries, latent-space attention, W_v on its output."""
        nope = q_nope.shape[-1]
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_kv[:, :nope])
        o_latent = sparse_mla.sparse_mla_attention(
            q_latent, q_rope, latent, selection, block_tables=meta.block_tables, seq_of_token=seq_of_token,
            page_size=meta.page_size, scale=scale, latent_scale=latent_scale)
        return torch.einsum("nhc,hvc->nhv", o_latent, w_kv[:, nope:])

    @staticmethod
    def _expanded_spans(q_nope, q_rope, selection, meta: VarlenBatch, w_kv) -> list[tuple[int, int, int]]:
        """(first token, end token, sequence) of the prefill chunks of this step that the cost rule
        (``kernels.sparse_mla_expanded.prefer_expanded``) runs in the expanded form. The rule looks at
        each chunk alone, so a chunk's form (and its rounding) never depends on what else is in the
        batch. Decode tokens and the static (compiled decode) batch always run absorbed."""
        if meta.static:
            return []
        nope, cu = q_nope.shape[-1], meta.cu_q.tolist()
        dims = dict(heads=q_nope.shape[1], kv_rank=w_kv.shape[2], rope_dim=0 if q_rope is None else q_rope.shape[-1],
                    nope_dim=nope, v_dim=w_kv.shape[1] - nope, topk=selection.shape[1])
        return [(cu[b], cu[b] + ql, b) for b, (ql, ctx) in enumerate(zip(meta.q_lens, meta.ctx_lens))
                if ql > 1 and prefer_expanded([(ql, ctx)], **dims)]

    # ---- FFN -------------------------------------------------------------------------------------

    def rms_norm(self, x, weight, eps):
        out = norm_rope.rms_norm(x, weight, eps) if self.native else None
        return norm.rms_norm(x, weight, eps) if out is None else out

    def rope_rotate_half(self, x, cos, sin):
        out = norm_rope.rope_rotate_half(x, cos, sin) if self.native else None
        return rope.apply_rope_rotate_half(x, cos, sin) if out is None else out

    def swiglu(self, gate, up, limit=None):
        out = swiglu.swiglu(gate, up, limit) if self.native else None
        return moe.swiglu(gate, up, limit) if out is None else out

    def greedy(self, logits):
        out = argmax.argmax(logits) if self.native else None
        return super().greedy(logits) if out is None else out

    def route(self, x, router_weight, correction_bias, *, top_k, n_group, topk_group, norm_topk_prob, scaling):
        return moe.route(x, router_weight, correction_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                         norm_topk_prob=norm_topk_prob, scaling=scaling)

    def moe_experts(self, x, weights, ids, gate_up, down, swiglu_limit):
        return moe.grouped_experts(x, weights, ids, gate_up, down, swiglu_limit, act=self.swiglu)

    def moe_experts_int8(self, x, weights, ids, gate_up_q, gate_up_scale, down_q, down_scale, swiglu_limit,
                         plan=None):
        return moe.grouped_experts_int8(x, weights, ids, gate_up_q, gate_up_scale, down_q, down_scale, swiglu_limit,
                                        linear=None if plan is None else plan.linear, act=self.swiglu)

    def dense_linear(self, x, weight, bias, fmt="aten"):
        return linear_plan.linear(fmt, x, weight, bias)

    def int8_linear(self, x, qweight, scale, bias, plan=None):
        if plan is None:
            return quant_matmul.int8_linear(x, qweight, scale, bias)
        return plan.linear(x, qweight, scale, bias)

    def block_linear(self, x, kind, packed, out_features, bias):
        if self.native and block_gemm.takes(x, packed, bias):
            return block_gemm.block_linear(x, kind, packed, out_features, bias)
        return gguf_blocks.block_linear(x, kind, gguf_blocks.unrepack(kind, packed, out_features), bias)

    # ---- mHC -------------------------------------------------------------------------------------

    # mHC: eager steps (prefill and mixed steps under static graphs too) run the native kernels
    # where they build: the normed streams, the per-token weights (~120 tiny torch ops) and the
    # collapse. Without them, the torch functions, through torch.compile when the model asked for
    # it (`compiled`: 1.3x slower a tiny-flash prefill than native, measured). Inside a compiled
    # graph the torch function is traced into it (as a nested compile would be), with the native
    # per-token weights as one opaque op: traced, their Sinkhorn iterations are half the graph.

    def mhc_pre(self, streams, fn, base, scale, *, norm_eps, hc_eps, sinkhorn_iters, compiled=False):
        kw = dict(norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
        out = mhc_weights.hc_pre(streams, fn, base, scale, **kw) if self.native else None
        if out is not None:
            return out
        if torch.compiler.is_compiling():
            return mhc.hc_pre(streams, fn, base, scale, **kw,
                              weights=mhc_weights.weights_op if self.native else mhc.hc_weights)
        if compiled:
            return compiled_fn(mhc.hc_pre)(streams, fn, base, scale, **kw)
        return mhc.hc_pre(streams, fn, base, scale, **kw)

    def mhc_post(self, y, streams, post, comb, *, compiled=False):
        out = mhc_weights.mhc_post(y, streams, post, comb) if self.native else None
        if out is not None:
            return out
        if compiled and not torch.compiler.is_compiling():
            return compiled_fn(mhc.hc_post)(y, streams, post, comb)
        return mhc.hc_post(y, streams, post, comb)
