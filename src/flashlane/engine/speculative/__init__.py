"""Speculative decoding: a drafter proposes the next tokens of a decoding request, one forward
verifies them beside the rest of the batch, and the caches keep only what was accepted.

Built here: n-gram prompt lookup (any architecture, no weights), the models' own MTP layer (GLM),
greedy verification and rejection sampling (and synthetic acceptance for benchmarks), and an
exact rollback of per-sequence state (KDA recurrent + conv state, indexer tail) by snapshot and
replay. With static graphs, verify steps and the MTP layer's passes run compiled where their
shapes allow (``engine.compiled_decode``). Requests that ask for logprobs or follow a grammar
decode one token per step as before.
"""

from .config import SpeculativeConfig
from .mtp import MtpDrafter, MtpPass
from .ngram import NgramDrafter
from .verify import accept_greedy, accept_sampled, accept_synthetic

__all__ = ["SpeculativeConfig", "MtpDrafter", "MtpPass", "NgramDrafter", "accept_greedy", "accept_sampled",
           "accept_synthetic"]
