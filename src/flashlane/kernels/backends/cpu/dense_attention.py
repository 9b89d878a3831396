"""Dense causal GQA attention over a paged KV pool: gather plan + torch SDPA (plain-torch path).
When the backend turned the native kernels on, decode rows of a float32 or bf16 pool read the
pool in place (``kernels/native/paged_attention``); prefill chunks attend straight from the
pages, over a bf16 pool on AMX tiles (``kernels/native/prefill_attention``) where the CPU has
AMX, over a float32 pool by FMA vectors (``kernels/native/prefill_attention_f32``); else a
chunk after cached history merges its two flash parts in one pass
(``kernels/native/attention_merge``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...kv_store import gather_rows, write_rows
from ...native import attention_merge, paged_attention, prefill_attention, prefill_attention_f32
from ..base import VarlenBatch


@dataclass
class _Group:
    """Sequences attended together: their tokens padded to [B, Q], their history to [B, T]."""

    tokens: torch.Tensor          # [B, Q] flat token index
    rows: torch.Tensor            # [B, T] flat pool row of each history position
    mask: torch.Tensor | None     # [B, 1, Q, T] bool, None = plain causal from position 0
    # decode groups (Q = 1): each sequence's block table and length (int64, contiguous) and the
    # lengths' sum, for the in-place native path
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None
    history: int | None = None
    every_row: bool = False       # the group's tokens are all the forward's tokens, in order
    start: int = 0                # a prefill chunk: its first position (the cached history before it)
    table: torch.Tensor | None = None   # a prefill chunk: its sequence's block table row
    first: int = 0                # a prefill chunk: its first token in the forward


class AttentionPlan:
    """Gather indices and masks of one forward, shared by all layers.

    Decode tokens of all sequences form one group (one batched gather, length mask);
    each prefill chunk is its own group so the [Q, T] score matrix is never padded up to
    the longest chunk times the number of sequences.
    """

    def __init__(self, batch: VarlenBatch):
        dev = batch.block_tables.device
        page = batch.page_size
        self.groups: list[_Group] = []
        if batch.static:   # q tokens per sequence, history up to the table's width, masked by position
            q = batch.rows_per_seq
            rows = self._rows(batch.block_tables, batch.block_tables.shape[1] * page, page)
            t = torch.arange(rows.shape[1], device=dev)
            tokens = torch.arange(rows.shape[0] * q, device=dev).view(-1, q)
            mask = (t <= batch.positions.view(-1, q, 1))[:, None]
            self.groups.append(_Group(tokens, rows, mask, batch.block_tables if q == 1 else None,
                                      batch.ctx_lens_t, every_row=True))
            return
        cu = [0]
        for q in batch.q_lens:
            cu.append(cu[-1] + q)
        decode = [b for b, q in enumerate(batch.q_lens) if q == 1]
        if decode:
            idx = torch.tensor(decode, dtype=torch.long, device=dev)
            t_max = max(batch.ctx_lens[b] for b in decode)
            rows = self._rows(batch.block_tables[idx], t_max, page)
            t = torch.arange(t_max, device=dev)
            mask = (t[None, :] < batch.ctx_lens_t[idx][:, None])[:, None, None, :]
            tokens = torch.tensor([cu[b] for b in decode], dtype=torch.long, device=dev)[:, None]
            self.groups.append(_Group(tokens, rows, mask, batch.block_tables[idx].contiguous(),
                                      batch.ctx_lens_t[idx].contiguous(), sum(batch.ctx_lens[b] for b in decode),
                                      every_row=len(decode) == cu[-1]))
        for b, q in enumerate(batch.q_lens):
            if q <= 1:
                continue
            ctx, start = batch.ctx_lens[b], batch.ctx_lens[b] - q
            rows = self._rows(batch.block_tables[b : b + 1], ctx, page)
            tokens = torch.arange(cu[b], cu[b] + q, device=dev)[None]
            mask = None
            if start and not _splits(dev):
                t = torch.arange(ctx, device=dev)
                p = torch.arange(start, ctx, device=dev)
                mask = (t[None, :] <= p[:, None])[None, None]
            self.groups.append(_Group(tokens, rows, mask, start=start, table=batch.block_tables[b], first=cu[b]))

    @staticmethod
    def _rows(tables: torch.Tensor, length: int, page: int) -> torch.Tensor:
        t = torch.arange(length, device=tables.device)
        pages = tables.gather(1, (t // page).clamp(max=tables.shape[1] - 1).expand(tables.shape[0], -1))
        return pages * page + t % page


# torch's CPU flash-attention kernel, which also returns each row's log-sum-exp
_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _splits(device: torch.device) -> bool:
    """Whether a prefill chunk after cached history attends in two parts (``_after_history``)."""
    return _flash is not None and device.type == "cpu" and not torch.compiler.is_compiling()


def _after_history(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                   native: bool = False) -> torch.Tensor:
    """Attention of a prefill chunk whose queries sit at positions ``start..`` over keys 0..T-1
    (q [B, Hq, Q, D], k/v [B, Hkv, T, D]): the cached history unmasked and the chunk's own keys
    causally, two flash calls merged by their log-sum-exps. Equal to one call with the [Q, T]
    causal mask up to rounding; with the mask torch's CPU kernel reads it and computes every
    block, about 1.5x slower for a 2K chunk after 2-6K of history. ``native``: the two parts are
    merged by the native kernel where it takes them (one pass, 0.2 ms a layer for a 512-token bf16
    chunk on one thread, where torch's ops below take 1.7 ms)."""
    o1, l1 = _flash(q, k[:, :, :start], v[:, :, :start])[:2]
    o2, l2 = _flash(q, k[:, :, start:], v[:, :, start:], is_causal=True)[:2]
    merged = attention_merge.merge(o1, l1, o2, l2) if native else None
    if merged is not None:
        return merged
    top = torch.maximum(l1, l2)
    w1, w2 = (l1 - top).exp_().unsqueeze(-1), (l2 - top).exp_().unsqueeze(-1)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor,
                    pool_scale: torch.Tensor | None, meta: VarlenBatch, plan: AttentionPlan,
                    native: bool = False) -> torch.Tensor:
    """Write ``[K | V]`` of the new tokens at ``meta.slot_mapping``, then attend each group
    (``native``: decode groups through the in-place kernel where it supports them, prefill chunks
    through the AMX (bf16) or FMA (float32) kernel where one supports them, else a chunk's two
    attention parts merged by the native kernel)."""
    n, num_heads, d = q.shape
    num_kv = k.shape[1]
    write_rows(pool, pool_scale, meta.slot_mapping, torch.cat((k.reshape(n, -1), v.reshape(n, -1)), -1))
    native_decode = native and paged_attention.supports(q, pool, pool_scale)
    prefill_kernel = None
    if native and prefill_attention.supports(q, pool, pool_scale):
        prefill_kernel = prefill_attention.prefill_attention
    elif native and prefill_attention_f32.supports(q, pool, pool_scale, num_kv) and prefill_attention_f32.preferred():
        prefill_kernel = prefill_attention_f32.prefill_attention
    if native_decode and len(plan.groups) == 1 and plan.groups[0].every_row and plan.groups[0].tables is not None:
        g = plan.groups[0]
        return paged_attention.decode_attention(q, pool, g.tables, g.lens, num_kv, meta.page_size, history=g.history)
    out = torch.empty_like(q)
    for g in plan.groups:
        if native_decode and g.tables is not None:
            tok = g.tokens.reshape(-1)
            out[tok] = paged_attention.decode_attention(q[tok], pool, g.tables, g.lens, num_kv, meta.page_size,
                                                        history=g.history)
            continue
        bsz, qlen = g.tokens.shape
        if prefill_kernel is not None and g.table is not None:
            rows = slice(g.first, g.first + qlen)
            prefill_kernel(q[rows], pool, g.table, g.start, num_kv, meta.page_size, out[rows])
            continue
        kv = gather_rows(pool, pool_scale, g.rows, q.dtype).view(bsz, g.rows.shape[1], 2, num_kv, d)
        qg = q[g.tokens].transpose(1, 2)                     # [B, Hq, Q, D]
        kg = kv[:, :, 0].transpose(1, 2)                     # [B, Hkv, T, D]
        vg = kv[:, :, 1].transpose(1, 2)
        if g.start and g.mask is None:
            o = _after_history(qg, kg, vg, g.start, native)
        else:
            o = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=g.mask, is_causal=g.mask is None and qlen > 1,
                enable_gqa=num_kv != num_heads,
            )
        out[g.tokens.reshape(-1)] = o.transpose(1, 2).reshape(bsz * qlen, num_heads, d)
    return out
