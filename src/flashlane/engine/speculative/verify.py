"""Verification of drafts against the target model: greedy (its own choices) and rejection
sampling (its sampling distribution)."""

from __future__ import annotations

import torch


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """The tokens a request gains: the drafts the model agrees with, then the model's own next
    token. ``target[i]`` is the model's greedy token after the i-th verified position (the last
    real token first), so ``len(target) == len(draft) + 1``."""
    if len(target) != len(draft) + 1:
        raise ValueError(f"{len(draft)} drafts need {len(draft) + 1} target tokens, got {len(target)}")
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target[accepted]:
        accepted += 1
    return target[: accepted + 1]


def accept_sampled(probs: torch.Tensor, draft: list[int], uniforms: torch.Tensor) -> list[int]:
    """Rejection sampling of drafts proposed with certainty (n-gram: the draft distribution is a
    point mass), which leaves the output distribution exactly the target's: draft ``d`` at
    position i is kept with probability ``p_i(d)``; on the first rejection the token is drawn
    from ``p_i`` without ``d`` (renormalised) and the run ends; when every draft is kept, one
    more token is drawn from ``p_k``. ``probs`` [k+1, V]: the target's sampling distributions
    (``kernels.sampling.sampling_probs``); ``uniforms`` [k+1, 2] in [0, 1)."""
    out: list[int] = []
    for i, d in enumerate(draft):
        p = probs[i]
        if float(uniforms[i, 0]) < float(p[d]):
            out.append(d)
            continue
        rest = p.clone()
        rest[d] = 0.0
        out.append(_draw(rest, float(uniforms[i, 1])))
        return out
    out.append(_draw(probs[len(draft)], float(uniforms[len(draft), 1])))
    return out


def accept_synthetic(draft: list[int], target: list[int], rate: float, uniforms: torch.Tensor) -> list[int]:
    """Benchmarks only: each draft is kept with probability ``rate`` (until the first miss),
    whatever the model says, then the model's own token at that position follows (``target``:
    its tokens after each verified position, as in ``accept_greedy``). ``uniforms`` [k]."""
    accepted = 0
    while accepted < len(draft) and float(uniforms[accepted]) < rate:
        accepted += 1
    return draft[:accepted] + [target[accepted]]


def _draw(p: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(p, dim=0)
    at = torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)
    return int(at.clamp_(max=p.shape[0] - 1))
