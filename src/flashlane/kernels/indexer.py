"""DSA lightning indexer: key cache writes (per-token or pooled with a tail ring) and top-k selection.

One code path serves both variants; a per-token indexer (glm_moe_dsa) is the pooled one with
``kpool = 1`` (every token is its own complete pool, no tail). Spec §1.7 / §2.

Cache layout (see cache_spec): ``index_keys`` [entries, D] holds one key per complete pool,
addressed through the block table; ``index_tail`` [slots, kpool, 2D] holds ``[kI | gI]`` of the
tokens of a sequence's in-progress pool at ring index ``position % kpool``.

Selection output per query: ``topk`` pool-token slots (selected pools in descending score order,
each expanded to its ``kpool`` positions) followed, with ``always_select_tail``, by ``kpool - 1``
tail slots; absolute positions, ``-1`` = empty. Ties break towards the lower pool index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_store import gather_rows, write_rows
from .paged import pooled_rows

# Max fp32 elements of one [queries, heads, pools] score block; bounds prefill memory.
_SCORE_BLOCK = 1 << 24


def pool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Pooled key ``sum_m softmax_m(g_m + ape_m) * k_m`` per channel: [M, P, D] x2, [P, D] -> [M, D]."""
    prob = torch.softmax(gates.float() + ape.float(), dim=-2).to(keys.dtype)
    return (prob * keys).sum(dim=-2)


def selection_width(topk: int, kpool: int, always_select_tail: bool) -> int:
    return topk + (kpool - 1 if always_select_tail and kpool > 1 else 0)


def write_index_keys(index_keys: torch.Tensor, keys: torch.Tensor, *, slot_mapping: torch.Tensor,
                     page_size: int, kpool: int = 1, gates: torch.Tensor | None = None,
                     ape: torch.Tensor | None = None, tail: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None, seq_of_token: torch.Tensor | None = None,
                     start_of_seq: torch.Tensor | None = None, ctx_of_seq: torch.Tensor | None = None,
                     block_tables: torch.Tensor | None = None,
                     state_slots: torch.Tensor | None = None,
                     key_scale: torch.Tensor | None = None,
                     tail_steps: torch.Tensor | None = None) -> None:
    """Store the new tokens' index keys ([N, D], in flat-batch order, positions ascending per
    sequence; int8 ``index_keys`` come with ``key_scale``, see ``kv_store``). ``kpool == 1``:
    one key per token at ``slot_mapping``. ``kpool > 1``: every pool whose last token is new is
    compressed (older members come from the tail ring) and written once; tokens of each
    sequence's still-incomplete pool go to the tail ring (kept unquantised).

    ``tail_steps`` [>= B, S, kpool, 2D], only where every one of the ``B`` sequences has S + 1 new
    tokens (a static verify step): the ring as single-token steps would leave it after each of a
    sequence's first S tokens (every token but a pool's last goes to its ring entry)."""
    if kpool == 1:
        write_rows(index_keys, key_scale, slot_mapping, keys)
        return
    if gates is None or ape is None or tail is None:
        raise ValueError("pooled index keys (kpool > 1) need gates, ape and the tail ring")
    d = keys.shape[1]
    seq = seq_of_token
    slot = state_slots[seq]
    start = start_of_seq[seq]
    packed = torch.cat([keys, gates], dim=-1).to(tail.dtype)                     # [N, 2D]
    if tail_steps is not None:
        _ring_steps(tail_steps, tail, packed, positions, state_slots, kpool)

    # Branch-free, so a compiled decode step has no data-dependent shapes: every token computes
    # its pool's key, and rows that complete no pool (or are not pending) write to row/slot 0 of
    # the null page/slot, which nothing reads.
    done = (positions % kpool) == kpool - 1                                      # pool completed
    member = torch.arange(kpool, device=keys.device)
    member_pos = (positions // kpool * kpool)[:, None] + member                   # [N, P]
    from_new = member_pos >= start[:, None]
    # new tokens of a sequence are contiguous and ascending in the flat batch
    token = torch.arange(keys.shape[0], device=keys.device)
    new_src = (token[:, None] - (positions[:, None] - member_pos)).clamp(0, keys.shape[0] - 1)
    pool = torch.where(from_new[..., None], packed[new_src], tail[slot[:, None], member])  # [N, P, 2D]
    pooled = pool_keys(pool[..., :d], pool[..., d:], ape)
    rows = pooled_rows(block_tables, seq, positions // kpool, page_size, kpool)
    write_rows(index_keys, key_scale, torch.where(done, rows, 0), pooled)

    pending = positions >= ctx_of_seq[seq] // kpool * kpool
    tail[torch.where(pending, slot, 0), positions % kpool] = packed


def _ring_steps(out: torch.Tensor, tail: torch.Tensor, packed: torch.Tensor, positions: torch.Tensor,
                state_slots: torch.Tensor, kpool: int) -> None:
    b, steps = state_slots.shape[0], out.shape[1]
    per_seq = packed.shape[0] // b
    ring = tail[state_slots]                                                     # [B, P, 2D]
    packed, residue = packed.view(b, per_seq, -1), (positions % kpool).view(b, per_seq)
    member = torch.arange(kpool, device=packed.device)
    for j in range(steps):
        hit = (member == residue[:, j, None]) & (residue[:, j, None] != kpool - 1)
        ring = torch.where(hit[..., None], packed[:, j, None], ring)
        out[:b, j] = ring


def _score_pools(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``sum_h w[h] * ReLU(q_h . k_p * scale)``: q [G, S, H, D], w [G, S, H], keys [G, M, D] -> [G, S, M]."""
    g, n, h, d = q.shape
    # one [S*H, D] x [D, M] product per sequence: a broadcast matmul over S ([G, S, H, D] x
    # [G, 1, D, M]) runs S tiny ones, ~3x slower
    s = torch.matmul(q.float().reshape(g, n * h, d), keys.float().transpose(-1, -2)).view(g, n, h, -1)
    s = s.mul_(scale).relu_()                  # in place: the largest tensor here
    return torch.matmul(w.float().unsqueeze(-2), s).squeeze(-2)


def _top_pools(scores: torch.Tensor, n: int, threshold: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the ``n`` highest scores along the last dim, highest first, equal scores lower
    index first: the first ``n`` of a stable descending sort, without sorting all of them.
    ``threshold``: the n-th highest score [..., 1] where known. Shape-stable (no data-dependent
    sizes), so it also runs in a compiled decode step; exact while M <= 2**24."""
    if threshold is None:
        threshold = scores.topk(n, dim=-1).values[..., -1:]
    # all scores above the threshold are in; of those equal to it, the lowest indices
    rank = torch.arange(scores.shape[-1], 0, -1, device=scores.device, dtype=scores.dtype)
    key = torch.where(scores > threshold, float("inf"), torch.where(scores == threshold, rank, -1.0))
    return _order_picks(scores, key.topk(n, dim=-1).indices)


def _order_picks(scores: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """``picks`` (indices into the last dim of ``scores``) by descending score, lower index first."""
    picks = picks.sort(dim=-1).values
    order = scores.gather(-1, picks).sort(dim=-1, descending=True, stable=True).indices
    return picks.gather(-1, order)


def _top_pools_prefill(scores: torch.Tensor, n: int) -> torch.Tensor:
    """``_top_pools`` with one topk for the rows whose n-th and (n+1)-th scores differ (no tie
    straddles the cut, so topk's set is the right one); the others take the exact path."""
    if n == scores.shape[-1]:
        return _order_picks(scores, torch.arange(n, device=scores.device).expand_as(scores))
    vals, picks = scores.topk(n + 1, dim=-1)
    picks = _order_picks(scores, picks[..., :n])
    straddle = vals[..., n] == vals[..., n - 1]
    if straddle.any():
        picks[straddle] = _top_pools(scores[straddle], n, vals[straddle][:, n - 1:n])
    return picks


@dataclass(frozen=True)
class SelectionKernels:
    """A backend's own kernels for the selection, each returning None where it declines (then
    torch's runs): ``scores(q, w, keys, scale)`` as ``_score_pools`` (to float32 rounding; prefill
    blocks only, so decode rows score as a compiled step does), ``top(scores, n)`` ordered exactly
    as ``_top_pools`` (prefill blocks and eager decode rows)."""
    scores: Callable | None = None
    top: Callable | None = None


def _pick_pools(q, w, keys, visible_pools, *, n_sel, kpool, scale, prefill=False, kernels=None):
    """Token slots of the ``n_sel`` best selectable pools of ``keys`` [G, M, D] for queries
    q [G, S, H, D] -> [G, S, n_sel * kpool], -1 = empty (also where M < n_sel). A pool is
    selectable below the query's ``visible_pools``. ``kernels``: the backend's
    ``SelectionKernels``."""
    m = keys.shape[1]
    n = min(n_sel, m)
    own = kernels or SelectionKernels()
    # decode rows keep torch's scores (as a compiled step's); the top-k is exact either way
    scores = own.scores(q, w, keys, scale) if prefill and own.scores is not None else None
    if scores is None:
        scores = _score_pools(q, w, keys, scale)
    if prefill:    # only pools at or past the block's smallest visible count can be masked
        lo = min(int(visible_pools.min()), m)
        tail = scores[..., lo:]
        tail.masked_fill_(torch.arange(lo, m, device=q.device) >= visible_pools[..., None], float("-inf"))
    else:
        scores = scores.masked_fill(torch.arange(m, device=q.device) >= visible_pools[..., None], float("-inf"))
    order = own.top(scores, n) if own.top is not None else None
    if order is None:
        order = _top_pools_prefill(scores, n) if prefill else _top_pools(scores, n)
    tok = order[..., None] * kpool + torch.arange(kpool, device=q.device)
    tok = tok.masked_fill((order >= visible_pools[..., None])[..., None], -1).flatten(-2)
    if n < n_sel:
        tok = F.pad(tok, (0, (n_sel - n) * kpool), value=-1)
    return tok


def _query_blocks(visible_pools: torch.Tensor, per_pool: int, m: int):
    """Split S prefill queries into blocks ``(start, end, pools)``: a block scores only the
    ``pools`` its queries can see (at least 1), as many queries as keep
    ``(end - start) * per_pool * pools`` within _SCORE_BLOCK (at least one)."""
    need = visible_pools.amax(0).cummax(0).values.clamp(1, m).tolist()   # nondecreasing
    budget = _SCORE_BLOCK // per_pool
    s, a = len(need), 0
    while a < s:
        lo, hi = a + 1, s      # largest end that fits: the cost grows with the end
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (mid - a) * need[mid - 1] <= budget:
                lo = mid
            else:
                hi = mid - 1
        yield a, lo, need[lo - 1]
        a = lo


def _select_group(q, w, keys, visible_pools, query_pos, *, topk, kpool, select_tail, scale, kernels=None):
    """Selection for G sequences with S queries each: q [G, S, H, D], w [G, S, H], keys [G, M, D]
    (pool p of sequence g), visible_pools [G, S], query_pos [G, S] -> [G, S, width]."""
    g, s = q.shape[:2]
    m = keys.shape[1]
    dev = q.device
    n_sel = min(topk // kpool, m)
    parts = []
    if n_sel > 0:
        opts = dict(n_sel=n_sel, kpool=kpool, scale=scale)
        if s == 1:    # decode: every pool scored, shapes set by M alone (a compiled step needs that)
            parts.append(_pick_pools(q, w, keys, visible_pools, kernels=kernels, **opts))
        else:         # prefill: a query block scores only the pools below its last query
            parts.append(torch.cat([
                _pick_pools(q[:, a:e], w[:, a:e], keys[:, :mv], visible_pools[:, a:e], prefill=True, kernels=kernels,
                            **opts)
                for a, e, mv in _query_blocks(visible_pools, g * q.shape[2], m)], dim=1))
    if n_sel * kpool < topk:
        parts.append(torch.full((g, s, topk - n_sel * kpool), -1, dtype=torch.long, device=dev))
    if select_tail and kpool > 1:
        visible = query_pos + 1
        r = visible % kpool
        j = torch.arange(kpool - 1, device=dev)
        tail = (visible - r)[..., None] + j
        parts.append(tail.masked_fill(j >= r[..., None], -1))
    return torch.cat(parts, dim=-1)


def select_positions_decode(q: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor, *,
                            positions: torch.Tensor, block_tables: torch.Tensor, page_size: int, topk: int,
                            kpool: int = 1, always_select_tail: bool = False, scale: float | None = None,
                            key_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``select_positions`` for one query per sequence (row b of every tensor is sequence b), with
    every pool the block table can address scored (those past a query's position masked), so
    the shapes depend only on the table's width: what a compiled decode step needs."""
    if topk % kpool:
        raise ValueError(f"index_topk ({topk}) must be a multiple of index_kpool ({kpool})")
    n, h, d = q.shape
    m = block_tables.shape[1] * page_size // kpool
    pools = torch.arange(m, device=q.device).expand(n, m)
    rows = pooled_rows(block_tables, torch.arange(n, device=q.device), pools, page_size, kpool)
    keys = gather_rows(index_keys, key_scale, rows, torch.float32)
    pos = positions[:, None]
    return _select_group(q[:, None], w[:, None], keys, (pos + 1) // kpool, pos, topk=topk, kpool=kpool,
                         select_tail=always_select_tail, scale=d ** -0.5 if scale is None else scale)[:, 0]


def select_positions(q: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor, *,
                     positions: torch.Tensor, q_lens: list[int], ctx_lens: list[int],
                     block_tables: torch.Tensor, page_size: int, topk: int, kpool: int = 1,
                     always_select_tail: bool = False, scale: float | None = None,
                     key_scale: torch.Tensor | None = None, kernels: SelectionKernels | None = None) -> torch.Tensor:
    """Positions each query attends: q [N, H, D], w [N, H] (head weights, already scaled),
    keys of every complete pool already in ``index_keys`` -> [N, width] int64, -1 = empty.

    A pool is selectable iff its last token is visible (position <= the query's). Decode-only
    sequences are scored in one batched call; each prefill sequence in its own call; both
    through ``kernels`` where given (see ``SelectionKernels``).
    """
    if topk % kpool:
        raise ValueError(f"index_topk ({topk}) must be a multiple of index_kpool ({kpool})")
    n, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    dev = q.device
    width = selection_width(topk, kpool, always_select_tail)
    out = torch.full((n, width), -1, dtype=torch.long, device=dev)
    opts = dict(topk=topk, kpool=kpool, select_tail=always_select_tail, scale=scale)

    def gather_keys(seq_ids: list[int], m: int) -> torch.Tensor:
        sid = torch.tensor(seq_ids, dtype=torch.long, device=dev)
        pools = torch.arange(m, device=dev).expand(len(seq_ids), m)
        rows = pooled_rows(block_tables, sid, pools, page_size, kpool)
        return gather_rows(index_keys, key_scale, rows, torch.float32)      # scored in fp32

    starts, at = [], 0
    for ql in q_lens:
        starts.append(at)
        at += ql
    dec = [b for b, ql in enumerate(q_lens) if ql == 1]
    if dec:
        m = max(ctx_lens[b] for b in dec) // kpool
        per = max(1, _SCORE_BLOCK // max(1, m * max(d, h)))    # bound the gathered keys too
        for a in range(0, len(dec), per):
            group = dec[a:a + per]
            tok = torch.tensor([starts[b] for b in group], dtype=torch.long, device=dev)
            pos = positions[tok][:, None]
            out[tok] = _select_group(q[tok][:, None], w[tok][:, None], gather_keys(group, m),
                                     (pos + 1) // kpool, pos, kernels=kernels, **opts)[:, 0]
    for b, ql in enumerate(q_lens):
        if ql <= 1:
            continue
        sl = slice(starts[b], starts[b] + ql)
        pos = positions[sl][None]
        out[sl] = _select_group(q[sl][None], w[sl][None], gather_keys([b], ctx_lens[b] // kpool),
                                (pos + 1) // kpool, pos, kernels=kernels, **opts)[0]
    return out
