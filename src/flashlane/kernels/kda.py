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
                  initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step-by-step KDA over ``T`` steps for ``B`` independent sequences.

    q, k, g: [B, T, H, Dk]; v: [B, T, H, Dv]; beta: [B, T, H]; initial_state: [B, H, Dk, Dv] or None
    (zeros). Returns (o [B, T, H, Dv] in v's dtype, final state [B, H, Dk, Dv] fp32).
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
    return out.to(v.dtype), state


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state_pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor | None = None) -> torch.Tensor:
    """One step for ``B`` sequences whose states live in ``state_pool[slots]`` (updated in place).

    q, k, g: [B, H, Dk]; v: [B, H, Dv]; beta: [B, H]; state_pool: [S, H, Dk, Dv] fp32; slots: [B].
    ``fresh`` [B] bool marks sequences at position 0 whose slot content must be ignored.
    Returns o [B, H, Dv].
    """
    state = state_pool.index_select(0, slots)
    if fresh is not None:
        state = state.masked_fill(fresh.view(-1, 1, 1, 1), 0.0)
    out, state = kda_recurrent(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1),
                               beta.unsqueeze(1), state)
    state_pool.index_copy_(0, slots, state.to(state_pool.dtype))
    return out.squeeze(1)


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


__all__ = ["kda_gate", "kda_recurrent", "kda_decode", "kda_chunk"]
