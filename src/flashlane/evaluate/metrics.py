"""Accuracy measures on next-token log-probabilities: pure functions, no engine.

Inputs are float log-prob tensors [positions, vocab] (log_softmax already applied) and the
target token of each position."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def token_nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target token, float64 [positions]."""
    return -logprobs.gather(1, targets.long().unsqueeze(1)).squeeze(1).double()


def perplexity(nll_sum: float, num_tokens: int) -> float:
    """exp(mean NLL) over all scored tokens."""
    if num_tokens < 1:
        raise ValueError("perplexity needs at least one scored token")
    return math.exp(nll_sum / num_tokens)


def kl_divergence(ref_logprobs: torch.Tensor, cand_logprobs: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """KL(ref || cand) per position in nats, float64 [positions]; terms where ref has zero
    probability contribute nothing (0 log 0 = 0). Summed in float64, ``rows`` positions at a
    time (a 49K vocabulary makes each float64 row 400 KB)."""
    out = []
    for i in range(0, ref_logprobs.shape[0], rows):
        ref = ref_logprobs[i: i + rows].double()
        p = ref.exp()
        terms = p * (ref - cand_logprobs[i: i + rows].double())
        out.append(torch.where(p > 0, terms, 0.0).sum(dim=-1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def top1_matches(ref_logprobs: torch.Tensor, cand_logprobs: torch.Tensor) -> torch.Tensor:
    """Whether the candidate's most likely next token is the reference's, bool [positions]."""
    return ref_logprobs.argmax(dim=-1) == cand_logprobs.argmax(dim=-1)


def percentile(values: list[float] | torch.Tensor, q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between order statistics."""
    t = torch.as_tensor(values, dtype=torch.float64)
    if t.numel() == 0:
        raise ValueError("percentile of no values")
    return float(torch.quantile(t, q / 100.0))


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]]) -> dict[str, float]:
    """Agreement of greedy continuations of the same prompts, both as fractions of the
    reference's length: ``prefix`` = tokens equal up to the first divergence, ``positionwise`` =
    positions holding the same token (a later re-convergence counts), each averaged over prompts."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference continuations vs {len(candidate)} candidate ones")
    if not reference:
        raise ValueError("greedy agreement of no continuations")
    prefix, positionwise = [], []
    for ref, cand in zip(reference, candidate):
        if not ref:
            raise ValueError("an empty reference continuation")
        same = [i < len(cand) and cand[i] == t for i, t in enumerate(ref)]
        first_miss = same.index(False) if False in same else len(ref)
        prefix.append(first_miss / len(ref))
        positionwise.append(sum(same) / len(ref))
    return {"prefix": sum(prefix) / len(prefix), "positionwise": sum(positionwise) / len(positionwise)}


@dataclass
class Agreement:
    """Accumulates per-window comparisons so no window's logits outlive its own step."""

    positions: int = 0
    matches: int = 0
    kl: list[float] = field(default_factory=list)

    def add(self, ref_logprobs: torch.Tensor, cand_logprobs: torch.Tensor) -> None:
        if ref_logprobs.shape != cand_logprobs.shape:
            raise ValueError(f"log-prob shapes differ: {tuple(ref_logprobs.shape)} vs {tuple(cand_logprobs.shape)}")
        self.positions += ref_logprobs.shape[0]
        self.matches += int(top1_matches(ref_logprobs, cand_logprobs).sum())
        self.kl.extend(kl_divergence(ref_logprobs, cand_logprobs).tolist())

    def summary(self) -> dict[str, float]:
        if not self.positions:
            raise ValueError("no positions compared")
        return {"top1_agreement": self.matches / self.positions, "kl_mean": sum(self.kl) / len(self.kl),
                "kl_p99": percentile(self.kl, 99), "kl_max": max(self.kl), "positions": self.positions}


@dataclass
class Likelihood:
    """Accumulates NLL over windows for perplexity."""

    nll_sum: float = 0.0
    tokens: int = 0

    def add(self, logprobs: torch.Tensor, targets: torch.Tensor) -> None:
        self.nll_sum += float(token_nll(logprobs, targets).sum())
        self.tokens += int(targets.numel())

    def summary(self) -> dict[str, float]:
        return {"perplexity": perplexity(self.nll_sum, self.tokens), "mean_nll": self.nll_sum / self.tokens,
                "scored_tokens": self.tokens}
