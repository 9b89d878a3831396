"""Speculative decoding's acceptance, as a mean length and as a per-draft probability: the
engine's synthetic acceptance keeps each draft with the same probability ``p`` until the first
miss, so ``k`` drafts give a mean of ``1 + p + ... + p^k`` tokens per verify step. Torch-free:
the engine, the simulator and ``analyze`` read it from here.

``ASSUMED`` is the length the simulator and ``analyze`` take where none is given."""

from __future__ import annotations

# InferenceX's golden mean acceptance length for GLM-5.2 with 3 MTP drafts
ASSUMED = (2.99, 3)
ASSUMED_SOURCE = ("assumption: InferenceX's golden mean acceptance length for GLM-5.2 with 3 MTP drafts (2.99), as a "
                  "per-draft acceptance probability kept at every position (the engine's synthetic acceptance) for "
                  "other draft counts")


def mean_length(rate: float, k: int) -> float:
    """Mean tokens a verify step of ``k`` drafts gives when each is kept with probability ``rate``."""
    return sum(rate ** i for i in range(k + 1))


def rate_for_length(length: float, k: int) -> float:
    """The per-draft probability ``p`` whose mean length over ``k`` drafts is ``length`` (bisection;
    the length is monotone in p)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if mean_length(mid, k) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def assumed_length(k: int) -> float:
    """``ASSUMED`` carried to ``k`` drafts at the same per-draft probability."""
    return mean_length(rate_for_length(*ASSUMED), k)
