"""Vectorised sampling over a batch: temperature, top-k, top-p, min-p, greedy rows.

Randomness enters only through one uniform number per row, drawn by the caller from the row's
own generator, so a seeded request samples the same token whatever else shares the batch: the
token is the inverse of the row's CDF at that number.

A full sort of the vocabulary costs ~4 ms a row on one core (SmolLM2's 49,152 tokens; 30 of a
92 ms batch-8 decode step served at temperature 1), so nothing is sorted unless it must be. Rows
without top-k, top-p or min-p invert the CDF in vocabulary order. Truncated rows take the top 64,
then 1,024, probabilities while every row's kept tokens provably lie within them (its top-k fits,
or their mass already reaches its top-p, or the last of them falls below its min-p), and sort the
whole vocabulary only otherwise.
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
    out = greedy.clone()
    truncated = _truncated(logits.shape[1], top_k, top_p, min_p)
    plain = (sampled_rows & ~truncated).nonzero().squeeze(1)
    if plain.numel():
        probs = torch.softmax(logits[plain] / temperature[plain].unsqueeze(1), dim=-1)
        out[plain] = _invert_cdf(probs, uniforms[plain])
    rows = (sampled_rows & truncated).nonzero().squeeze(1)
    if rows.numel():
        probs_kept, order = _kept_sorted(logits[rows], temperature[rows], top_k[rows], top_p[rows], min_p[rows])
        out[rows] = order.gather(1, _invert_cdf(probs_kept, uniforms[rows]).unsqueeze(1)).squeeze(1)
    return out


def _truncated(vocab: int, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Rows that top-k, top-p or min-p restrict."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0)


def _invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of unnormalised probabilities [B, N]: the column where the CDF passes ``uniforms``
    [B] x the row's mass (a zero-probability column is never picked)."""
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms.to(cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)


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


PARTIAL_SORTS = (64, 1024)     # the top-N tried before a full sort


def _kept_sorted(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with temperature > 0: the tempered probabilities of the top N tokens (N up to the
    vocabulary, at least every kept token) sorted descending, with what top-k, top-p and min-p
    drop set to zero (unnormalised), and their token ids [B, N]."""
    probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    vocab = probs.shape[1]
    for n in PARTIAL_SORTS:
        if n >= vocab:
            break
        top, order = probs.topk(n, dim=-1)
        # every kept token is among these n: the row's top-k fits, or the mass of these n reaches
        # its top-p (the next token's mass before is >= p), or the n-th falls below its min-p
        inside = (((top_k > 0) & (top_k <= n)) | ((top_p < 1) & (top.sum(dim=-1) >= top_p))
                  | (top[:, -1] < min_p * top[:, 0]))
        if bool(inside.all()):
            return _keep(top, order, top_k, top_p, min_p)
    return _keep(*torch.sort(probs, dim=-1, descending=True), top_k, top_p, min_p)


def _keep(probs_sorted: torch.Tensor, order: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
          min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = probs_sorted.shape[1]
    rank = torch.arange(n, device=probs_sorted.device).unsqueeze(0)
    keep = rank < torch.where(top_k > 0, top_k, n).unsqueeze(1)
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
    if not bool(_truncated(logits.shape[1], top_k, top_p, min_p).any()):
        return torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
    probs_kept, order = _kept_sorted(logits, temperature, top_k, top_p, min_p)
    probs_kept = probs_kept / probs_kept.sum(dim=-1, keepdim=True)
    return torch.zeros(logits.shape, dtype=probs_kept.dtype, device=logits.device).scatter_(1, order, probs_kept)
