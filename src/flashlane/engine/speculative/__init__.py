"""Speculative decoding: a drafter proposes the next tokens of a decoding request, one forward
verifies them beside the rest of the batch, and the caches keep only what was accepted.

Built here: n-gram prompt lookup (any architecture, no weights), greedy verification and
rejection sampling, and an exact rollback of per-sequence state (KDA recurrent + conv state,
indexer tail) by snapshot and replay. Requests that ask for logprobs or follow a grammar decode
one token per step as before.
"""

from .config import SpeculativeConfig
from .ngram import NgramDrafter
from .verify import accept_greedy, accept_sampled

__all__ = ["SpeculativeConfig", "NgramDrafter", "accept_greedy", "accept_sampled"]
