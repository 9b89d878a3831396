"""Vectorised sampling over a batch: temperature, top-k, top-p, min-p, greedy rows.

Randomness enters only through one uniform number per row, drawn by the caller from the row's
own generator, so a seeded request samples the same token whatever else shares the batch.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, uniforms: torch.Tensor, argmax=None) -> torch.Tensor:
    """logits [B, V] float32; temperature/top_p/min_p [B] float; top_k [B] long (<= 0: off);
    uniforms [B] in [0, 1). Rows with temperature 0 are greedy. Returns token ids [B] (long).
    ``argmax(logits)``: the backend's greedy pick (default ``torch.argmax`` over the last dim)."""
    greedy = logits.argmax(dim=-1) if argmax is None else argmax(logits)
    sampled_rows = temperature > 0
    if not bool(sampled_rows.any()):
        return greedy
    rows = sampled_rows.nonzero().squeeze(1)
    probs_sorted, order = _kept_sorted(logits[rows], temperature[rows], top_k[rows], top_p[rows], min_p[rows])
    vocab = probs_sorted.shape[1]
    cdf = torch.cumsum(probs_sorted, dim=-1)
    target = uniforms[rows].to(cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    out = greedy.clone()
    out[rows] = order.gather(1, pick).squeeze(1)
    return out


def topk_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[dict[int, float]]:
    """Per row: the top-k token logprobs plus the chosen token's (vLLM's logprobs meaning)."""
    out: list[dict[int, float]] = []
    top_vals, top_ids = (logprobs.topk(k, dim=-1) if k > 0 else (None, None))
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    chosen_ids = chosen.tolist()
    for i in range(logprobs.shape[0]):
        row = {chosen_ids[i]: chosen_lp[i]}
        if k > 0:
            for t, v in zip(top_ids[i].tolist(), top_vals[i].tolist()):
                row.setdefault(t, v)
        out.append(row)
    return out


def _kept_sorted(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with temperature > 0: the tempered probabilities sorted descending with what top-k,
    top-p and min-p drop set to zero (unnormalised), and the token order of that sort."""
    lg = logits / temperature.unsqueeze(1)
    probs_sorted, order = torch.sort(torch.softmax(lg, dim=-1), dim=-1, descending=True)
    vocab = probs_sorted.shape[1]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    keep = rank < torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
    # top-p: keep the smallest prefix whose mass reaches p (the first token always survives)
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    keep &= mass_before < top_p.unsqueeze(1)
    keep &= probs_sorted >= min_p.unsqueeze(1) * probs_sorted[:, :1]
    keep[:, 0] = True
    return torch.where(keep, probs_sorted, torch.zeros_like(probs_sorted)), order


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """The distribution ``sample`` draws from, per row (all temperature > 0), normalised, in
    vocabulary order [B, V]: what speculative decoding's rejection sampling verifies against."""
    probs_sorted, order = _kept_sorted(logits, temperature, top_k, top_p, min_p)
    probs_sorted = probs_sorted / probs_sorted.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs_sorted).scatter_(1, order, probs_sorted)
