"""Kimi Delta Attention (KDA): forget gate, step-by-step recurrence, chunked (WY) prefill form.

State orientation: ``[K, V]`` per head (key channels are rows), i.e. a state tensor is
``[..., H, Dk, Dv]`` float32 -- the layout of FLA's default and of the transformers reference.
One step of head ``h`` (``a = exp(g)`` per key channel, ``b`` a scalar write strength):

    S <- diag(a) S;   u = b * (v - S^T k);   S <- S + k u^T;   o = S^T q

All math is fp32; outputs are cast back to the dtype of ``v``. The kernels L2-normalise q and k
over the head dim (eps 1e-6 inside the sqrt) and scale q by ``Dk**-0.5`` themselves, so callers
pass the raw (post short-conv) q, k, v.
"""

from __future__ import annotations

import itertools
import math

import torch

SOFTPLUS_LINEAR_ABOVE = 20.0


def kda_gate(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,
             lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay ``g`` [..., H, D] (fp32, always <= 0) from the gate projection.

    ``f`` [..., H*D] is the low-rank gate output ``(x Wfa^T) Wfb^T``, ``dt_bias`` [H*D], ``A_log`` [H].
    Lower-bound form: ``g = lb * sigmoid(exp(A_log) * z)``; without a bound (``None``):
    ``g = -exp(A_log) * softplus(z)``, softplus linear above 20 (as the reference does).
    """
    heads = A_log.numel()
    if f.shape[-1] != dt_bias.numel() or f.shape[-1] % heads:
        raise ValueError(f"kda_gate: f has {f.shape[-1]} channels, dt_bias {dt_bias.numel()}, A_log {heads} heads")
    z = (f.float() + dt_bias.float()).unflatten(-1, (heads, -1))
    rate = A_log.float().exp().unsqueeze(-1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * z)
    softplus = torch.where(z > SOFTPLUS_LINEAR_ABOVE, z, torch.log1p(torch.exp(z)))
    return -rate * softplus


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.float(), k.float()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + eps)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + eps)
    return q * q.shape[-1] ** -0.5, k


def _check(q, k, v, g, beta, state, name: str) -> None:
    if not (q.shape == k.shape == g.shape):
        raise ValueError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)} and g {tuple(g.shape)} must match")
    if v.shape[:-1] != q.shape[:-1] or beta.shape != q.shape[:-1]:
        raise ValueError(f"{name}: v {tuple(v.shape)} / beta {tuple(beta.shape)} do not match q {tuple(q.shape)}")
    if state is not None:
        want = (*q.shape[:-3], q.shape[-2], q.shape[-1], v.shape[-1])
        if tuple(state.shape) != want:
            raise ValueError(f"{name}: state has shape {tuple(state.shape)}, expected {want}")


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None = None,
                  states_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step KDA over ``T`` steps for ``B`` independent sequences.

    q, k, g: [B, T, H, Dk]; v: [B, T, H, Dv]; beta: [B, T, H]; initial_state: [B, H, Dk, Dv] or None
    (zeros). Returns (o [B, T, H, Dv] in v's dtype, final state [B, H, Dk, Dv] fp32).
    ``states_out`` [B, S, H, Dk, Dv] (S < T): the state after each of the first S steps is written
    there as well (a speculative verify step keeps them to roll back by copying one).
    """
    _check(q, k, v, g, beta, initial_state, "kda_recurrent")
    b, t, h, dk = k.shape
    q, k = _prepare_qk(q, k)
    vf, gf, bf = v.float(), g.float(), beta.float()
    state = (torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.float().clone())
    out = torch.empty(b, t, h, v.shape[-1], dtype=torch.float32, device=v.device)
    for i in range(t):
        state = state * gf[:, i].exp().unsqueeze(-1)
        recalled = torch.einsum("bhkv,bhk->bhv", state, k[:, i])
        update = (vf[:, i] - recalled) * bf[:, i].unsqueeze(-1)
        state = state + k[:, i].unsqueeze(-1) * update.unsqueeze(-2)
        out[:, i] = torch.einsum("bhkv,bhk->bhv", state, q[:, i])
        if states_out is not None and i < states_out.shape[1]:
            states_out[:, i] = state
    return out.to(v.dtype), state


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None = None) -> torch.Tensor:
    """One step for ``B`` sequences whose states live in ``state_pool[slots]`` (updated in place).

    q, k, g: [B, H, Dk]; v: [B, H, Dv]; beta: [B, H]; state_pool: [S, H, Dk, Dv] fp32; slots: [B].
    ``fresh`` [B] bool marks sequences at position 0 whose slot content must be ignored.
    Returns o [B, H, Dv].
    """
    return kda_steps(q, k, v, g, beta, state_pool, slots, fresh, 1)


def kda_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None, steps: int,
              steps_out: torch.Tensor | None = None) -> torch.Tensor:
    """``kda_decode`` over ``steps`` tokens for each of ``B`` sequences (rows ``b * steps + j``; a
    static verify step): q, k, g [B * steps, H, Dk], v [B * steps, H, Dv], beta [B * steps, H]
    -> o [B * steps, H, Dv]. ``steps_out`` [>= B, steps - 1, H, Dk, Dv]: the state after each
    token but the last (see ``kda_recurrent``)."""
    b = slots.shape[0]
    state = state_pool.index_select(0, slots)
    if fresh is not None:
        state = state.masked_fill(fresh.view(-1, 1, 1, 1), 0.0)
    split = lambda t: t.reshape(b, steps, *t.shape[1:])  # noqa: E731
    out, state = kda_recurrent(split(q), split(k), split(v), split(g), split(beta), state,
                               None if steps_out is None else steps_out[:b])
    state_pool.index_copy_(0, slots, state.to(state_pool.dtype))
    return out.reshape(v.shape)


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              initial_state: torch.Tensor | None = None, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY) KDA, same signature and result as :func:`kda_recurrent`.

    Within a chunk of C steps with cumulative log-decay ``G_t`` and chunk-start state ``S0``, the
    delta-rule corrections ``U`` solve the unit-lower-triangular system
    ``(I + diag(beta) A) U = diag(beta) (V - (K * exp(G)) S0)`` with
    ``A[t, s] = sum_c k_t[c] k_s[c] exp(G_t[c] - G_s[c])`` for s < t; then
    ``o_t = S0^T (q_t * exp(G_t)) + sum_{s<=t} (q_t . k_s exp(G_t - G_s)) u_s`` and
    ``S_C = diag(exp(G_C)) S0 + (K * exp(G_C - G))^T U``.
    Decay factors are only formed as ``exp`` of non-positive differences, so no overflow for any
    gate strength (the price is a [C, C, Dk] factor per head and chunk).
    """
    _check(q, k, v, g, beta, initial_state, "kda_chunk")
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q, k = _prepare_qk(q, k)
    # [B, H, T, D] layout: chunks are contiguous slices along dim 2
    q, k, vf, gf = (x.float().transpose(1, 2) for x in (q, k, v, g))
    bf = beta.float().transpose(1, 2)
    state = (torch.zeros(b, h, dk, dv, dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.float().clone())
    out = torch.empty(b, h, t, dv, dtype=torch.float32, device=v.device)
    for start in range(0, t, chunk_size):
        end = min(start + chunk_size, t)
        c = end - start
        qc, kc, vc, bc = q[:, :, start:end], k[:, :, start:end], vf[:, :, start:end], bf[:, :, start:end]
        gc = gf[:, :, start:end].cumsum(2)                                   # [B, H, C, Dk]
        causal = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
        w = (gc.unsqueeze(3) - gc.unsqueeze(2)).masked_fill_(~causal[..., None], float("-inf")).exp_()
        w.mul_(kc.unsqueeze(2))                          # [B, H, C(t), C(s), Dk]: k_s exp(G_t - G_s)
        # one batched matmul scores both k_t and q_t against every decayed k_s
        kq = torch.matmul(w, torch.stack((kc, qc), dim=-1))                 # [B, H, C, C, 2]
        kk, qk = kq[..., 0].tril(-1), kq[..., 1]
        system = torch.eye(c, device=v.device) + bc.unsqueeze(-1) * kk
        decay_in = gc.exp()
        rhs = bc.unsqueeze(-1) * (vc - (kc * decay_in) @ state)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, :, start:end] = (qc * decay_in) @ state + qk @ u
        last = gc[:, :, -1:]                                                  # [B, H, 1, Dk]
        state = state * last.transpose(-1, -2).exp() + (kc * (last - gc).exp()).transpose(-1, -2) @ u
    return out.transpose(1, 2).to(v.dtype), state


VARLEN_PAD = 16                       # short last chunks are padded to a multiple of this many steps
VARLEN_BLOCK_BYTES = 64 * 2**20       # bound on the intra-chunk temporaries of one block of chunks
# Largest decay span (see _sub_blocks) a sub-block may have: its exp() factors then stay within
# [e^-60, e^60], far inside fp32's normal range (about e^-87 .. e^88).
DECAY_SPAN_LIMIT = 60.0


def _check_varlen(q, k, v, g, beta, cu_seqlens, state, chunk_size) -> list[int]:
    if q.dim() != 3:
        raise ValueError(f"kda_chunk_varlen: q must be [N, H, Dk] flat tokens, got {tuple(q.shape)}")
    _check(q, k, v, g, beta, None, "kda_chunk_varlen")
    if chunk_size < 1:
        raise ValueError(f"kda_chunk_varlen: chunk_size must be >= 1, got {chunk_size}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"kda_chunk_varlen: cu_seqlens must be a 1-D integer tensor [B+1], got {cu_seqlens}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != q.shape[0] or any(b <= a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"kda_chunk_varlen: cu_seqlens must rise strictly from 0 to {q.shape[0]}, got {cu}")
    if state is not None:
        want = (len(cu) - 1, q.shape[1], q.shape[2], v.shape[-1])
        if tuple(state.shape) != want:
            raise ValueError(f"kda_chunk_varlen: state has shape {tuple(state.shape)}, expected {want}")
    return cu


def _block_bytes(cp: int, sub: int, dk: int, dv: int) -> int:
    """Rough fp32 temporaries of one chunk and head padded to ``cp`` steps, sub-blocks of ``sub``."""
    return 4 * ((cp // sub) * cp * dk + 6 * cp * cp + 10 * cp * (dk + dv) + dk * dv)


def _sub_blocks(gc: torch.Tensor) -> torch.Tensor:
    """Per chunk, the largest power-of-two sub-block length whose decay span is in range.

    ``gc`` [M, H, C, Dk] is the cumulative log-decay. A sub-block starting at step r has span
    ``max_c (G_r - G_end)``, the decay across it; length 1 always qualifies (span 0).
    """
    m, _, cp, dk = gc.shape
    chosen = torch.ones(m, dtype=torch.long, device=gc.device)
    todo = torch.ones(m, dtype=torch.bool, device=gc.device)
    size = cp & -cp                                   # largest power of two dividing cp
    while size > 1:
        blocks = gc.view(m, -1, cp // size, size, dk)
        ok = todo & ((blocks[..., 0, :] - blocks[..., -1, :]).flatten(1).amax(1) <= DECAY_SPAN_LIMIT)
        chosen[ok] = size
        todo &= ~ok
        if not todo.any():
            break
        size //= 2
    return chosen


def _intra_chunk(qc, kc, vc, gc, bc, sub: int):
    """All the work inside chunks that does not need the chunk-start state ``S0``.

    Inputs [M, H, C, D] (gc: cumulative log-decay, bc: [M, H, C]). Returns ``q_state``,
    ``o_local``, ``u0``, ``w``, ``kd`` [M, H, C, D] and ``decay`` [M, H, Dk] with
    ``o = q_state S0 + o_local``, corrections ``U = u0 - w S0`` and
    ``S_end = diag(decay) S0 + kd^T U``.

    The decay factor ``exp(G_t - G_s)`` (s <= t) is split at the first step r of the sub-block
    (``sub`` steps) holding t: ``exp(G_t - G_r) * exp(G_r - G_s)``, so the scores are plain matrix
    products. Bounds: ``G_t - G_r`` lies in [-span, 0] (t >= r in one sub-block); ``G_r - G_s``
    is <= span for s in that sub-block and <= 0 for s < r. With span <= DECAY_SPAN_LIMIT (chosen
    per chunk by _sub_blocks) nothing overflows or becomes denormal except a factor for s < r
    that underflows -- and then the true product is below that factor, < 1e-38, the value it
    stands for. So this is safe for any gate strength (strong gates just get shorter sub-blocks).
    """
    m, h, cp, dk = kc.shape
    ns = cp // sub
    g5, k5, q5 = (x.view(m, h, ns, sub, dk) for x in (gc, kc, qc))
    ref = g5[:, :, :, :1]                                                   # G_r per sub-block
    into = (g5 - ref).exp_()                                                # exp(G_t - G_r)
    rows = kc.new_empty(m, h, ns, 2 * sub, dk)                              # k rows, then q rows
    torch.mul(k5, into, out=rows[:, :, :, :sub])
    torch.mul(q5, into, out=rows[:, :, :, sub:])
    ends = torch.arange(sub, cp + 1, sub, device=gc.device)
    beyond = torch.arange(cp, device=gc.device) >= ends[:, None]            # s past sub-block's end
    cols = (ref - gc.unsqueeze(2)).masked_fill_(beyond[..., None], float("-inf")).exp_()
    cols.mul_(kc.unsqueeze(2))                                              # k_s exp(G_r - G_s)
    scores = torch.matmul(rows, cols.transpose(-1, -2))                     # [M, H, ns, 2 sub, C]
    del into, rows, cols
    # kk's entries on and above the diagonal are not exp of non-positive numbers, but finite, and
    # the unit-triangular solve reads only the strictly lower triangle; qk is masked
    system = (scores[:, :, :, :sub] * bc.view(m, h, ns, sub, 1)).view(m, h, cp, cp)
    qk = scores[:, :, :, sub:].reshape(m, h, cp, cp).tril_()
    # [u0 | w] = (I + diag(beta) tril(kk, -1))^-1 diag(beta) [V | K exp(G)]; inverting the small
    # [C, C] system and multiplying beats solving against Dk + Dv right-hand sides
    eye = torch.eye(cp, dtype=kc.dtype, device=kc.device).expand(m, h, cp, cp)
    t = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
    t.mul_(bc.unsqueeze(-2))
    decay_in = gc.exp()
    u0 = torch.matmul(t, vc)
    w = torch.matmul(t, kc * decay_in)
    o_local = torch.matmul(qk, u0)
    q_state = (qc * decay_in).sub_(torch.matmul(qk, w))
    last = gc[:, :, -1:]
    kd = kc * (last - gc).exp_()
    return q_state, o_local, u0, w, kd, last.squeeze(2).exp()


def _intra_block(qc, kc, vc, gc, bc):
    """_intra_chunk for a block, each chunk with its own sub-block length (usually all equal);
    chunks with short sub-blocks (strong gates: big decay factors) go in smaller pieces."""
    gc = gc.cumsum(2)
    sub = _sub_blocks(gc)
    m, h, cp, dk = kc.shape
    dv = vc.shape[-1]
    sizes = sub.unique().tolist()
    pieces = {size: max(1, VARLEN_BLOCK_BYTES // (h * _block_bytes(cp, size, dk, dv))) for size in sizes}
    if len(sizes) == 1 and pieces[sizes[0]] >= m:
        return _intra_chunk(qc, kc, vc, gc, bc, sizes[0])
    outs = None
    for size, piece in pieces.items():
        for sel in (sub == size).nonzero().squeeze(1).split(piece):
            part = _intra_chunk(*(x.index_select(0, sel) for x in (qc, kc, vc, gc, bc)), size)
            if outs is None:
                outs = [p.new_empty(m, *p.shape[1:]) for p in part]
            for out, p in zip(outs, part):
                out.index_copy_(0, sel, p)
    return outs


def _gather(x: torch.Tensor, idx: torch.Tensor, heads: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """Tokens ``idx`` [M, C] of ``x`` [N, H, ...] as fp32 [M, H, C, ...]; steps not ``real`` zeroed."""
    x = x[idx[:, None, :], heads].float()
    if real is not None:
        x.masked_fill_(~real.view(*real.shape[:1], 1, real.shape[1], *(1,) * (x.dim() - 3)), 0.0)
    return x


def kda_chunk_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None = None,
                     chunk_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over ``B`` packed sequences at once (the math of :func:`kda_chunk`).

    q, k, g: [N, H, Dk]; v: [N, H, Dv]; beta: [N, H] -- tokens of the sequences concatenated,
    sequence b being ``cu_seqlens[b]:cu_seqlens[b+1]`` (length >= 1; a decode token is a 1-step
    sequence); initial_state: [B, H, Dk, Dv] or None (zeros). Returns (o [N, H, Dv] in v's dtype,
    final states [B, H, Dk, Dv] fp32).

    Every sequence is cut into chunks of ``chunk_size`` steps; a shorter last chunk is padded with
    g = k = q = v = beta = 0, which is exact: padded steps neither decay the state (exp(0) = 1) nor
    write to it (beta = 0 makes their correction 0), and causality keeps them out of real steps.
    Everything inside chunks is done for all chunks of all sequences together (in blocks, to bound
    memory), leaving per chunk ``U = u0 - w S0``, ``S_end = diag(decay) S0 + kd^T U`` and
    ``o = q_state S0 + o_local``; only the state update runs chunk index by chunk index, batched
    over the sequences that still have a chunk at that index, and the outputs come after it.
    The default chunk size is the fastest on CPU (benchmarks/kda_varlen.py: 32 beat 64 and 128).
    """
    cu = _check_varlen(q, k, v, g, beta, cu_seqlens, initial_state, chunk_size)
    n, h, dk = k.shape
    dv = v.shape[-1]
    dev = v.device
    lengths = [b - a for a, b in itertools.pairwise(cu)]
    # longest first: the sequences still running at chunk index j are then rows 0..a_j-1
    order = sorted(range(len(lengths)), key=lambda b: -lengths[b])
    pad = math.gcd(chunk_size, VARLEN_PAD)

    q, k = _prepare_qk(q, k)
    heads = torch.arange(h, device=dev)[:, None]
    order_t = torch.tensor(order, dtype=torch.long, device=dev)
    state = (torch.zeros(len(order), h, dk, dv, dtype=torch.float32, device=dev) if initial_state is None
             else initial_state.float().index_select(0, order_t))
    out = torch.empty(n + 1, h, dv, dtype=torch.float32, device=dev)

    # chunks in step-major order: (chunk index j, row of the sequence in `order`, first token, length)
    chunks = []
    for j in range(-(-lengths[order[0]] // chunk_size)):
        for row, b in enumerate(order):
            start = cu[b] + j * chunk_size
            if start >= cu[b + 1]:
                break
            chunks.append((j, row, start, min(chunk_size, cu[b + 1] - start)))

    def pad_to(length):
        return min(chunk_size, -(-length // pad) * pad)

    steps = torch.arange(chunk_size, device=dev)
    lo = 0
    while lo < len(chunks):
        # a block: consecutive chunks with one padded length, as many as the memory bound allows
        # at sub-blocks of VARLEN_PAD steps (_intra_block splits it further for shorter ones)
        cp = pad_to(chunks[lo][3])
        limit = max(1, VARLEN_BLOCK_BYTES // (h * _block_bytes(cp, min(cp, VARLEN_PAD), dk, dv)))
        hi = lo + 1
        while hi < len(chunks) and hi - lo < limit and pad_to(chunks[hi][3]) == cp:
            hi += 1
        block = chunks[lo:hi]
        m = len(block)
        first = torch.tensor([c[2] for c in block], device=dev)
        idx = first[:, None] + steps[:cp]                                    # [m, cp] token ids
        real = None
        if any(c[3] < cp for c in block):
            real = steps[:cp] < torch.tensor([c[3] for c in block], device=dev)[:, None]
            idx = torch.where(real, idx, first[:, None])        # padding reads a real token, then zeroed
        inputs = (_gather(x, idx, heads, real) for x in (q, k, v, g, beta))
        q_state, o_local, u0, w, kd, decay = _intra_block(*inputs)

        starts = torch.empty(m, h, dk, dv, dtype=torch.float32, device=dev)
        a = 0
        while a < m:   # runs of chunks with one chunk index: consecutive rows of `state`
            b = a + 1
            while b < m and block[b][0] == block[a][0]:
                b += 1
            r0, r1 = block[a][1], block[b - 1][1] + 1
            starts[a:b] = state[r0:r1]
            s0 = starts[a:b].view(-1, dk, dv)
            u = torch.baddbmm(u0[a:b].view(-1, cp, dv), w[a:b].view(-1, cp, dk), s0, alpha=-1)
            s_end = torch.baddbmm(s0 * decay[a:b].view(-1, dk, 1), kd[a:b].view(-1, cp, dk).transpose(1, 2), u)
            state[r0:r1] = s_end.view(b - a, h, dk, dv)
            a = b
        o = torch.matmul(q_state, starts).add_(o_local)                     # [m, H, cp, Dv]
        dest = idx if real is None else torch.where(real, idx, n)            # padded steps land on row n
        out[dest[:, None, :], heads] = o
        lo = hi

    final = torch.empty_like(state).index_copy_(0, order_t, state)
    return out[:n].to(v.dtype), final


__all__ = ["kda_gate", "kda_recurrent", "kda_decode", "kda_chunk", "kda_chunk_varlen"]
