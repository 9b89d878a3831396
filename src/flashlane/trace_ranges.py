"""Named ranges for profilers: ``with profiling_range("mhc"): ...``.

While profiling is switched on (``set_profiling(True)``, done by flashlane's profilers, or
``FLASHLANE_PROFILE_RANGES=1`` for an external one such as Nsight Systems) a range is a
``torch.profiler.record_function`` (the name in torch.profiler tables and Chrome traces) and,
on CUDA, an NVTX range of the same name. Otherwise it is one shared no-op context:
``record_function`` still costs a dispatcher call and an object per use when no profiler runs,
and the models open a few hundred ranges per step.
"""

from __future__ import annotations

import contextlib
import os

import torch

RANGE_NAMES = (
    "engine_step",     # one LLMEngine.step (the profilers open it); its own time is engine overhead
    "model_forward",   # the model's forward; its own time is glue between the ranges below
    "embedding",
    "mhc",             # hyper-connection pre (collapse) and post (expand + mix)
    "norm",            # the decoder's pre-sublayer RMSNorms and the final norm
    "kda",             # Kimi delta attention token mixer
    "dsa_attention",   # MLA over the indexer's selection (the indexer itself excluded)
    "indexer",         # DSA lightning indexer: key write, scoring, top-k
    "attention",       # dense attention (llama)
    "decoder_layer",   # a whole llama decoder layer in one backend call (decode rows, native kernels)
    "moe_router",
    "moe_experts",     # routed experts
    "moe_shared",      # shared experts
    "mlp",             # dense FFN
    "lm_head",
    "sampling",        # log-softmax, logprobs and the draw (the lm_head inside excluded)
    "mtp",             # speculative decoding: the MTP layer drafting (its catch-up and chained steps)
    "draft_rollback",  # speculative decoding: the state back after a rejection (eager: a replay; graphs: a copy)
)

_NULL = contextlib.nullcontext()
_enabled = False
_nvtx = False   # also push NVTX ranges (CUDA present); decided when ranges are switched on


def set_profiling(on: bool) -> None:
    """Switch the named ranges on or off for every thread."""
    global _enabled, _nvtx
    _enabled = bool(on)
    _nvtx = _enabled and torch.cuda.is_available()


def profiling_enabled() -> bool:
    return _enabled


class _Range:
    __slots__ = ("name", "_record")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self._record = torch.profiler.record_function(self.name)
        self._record.__enter__()
        if _nvtx:
            torch.cuda.nvtx.range_push(self.name)
        return self

    def __exit__(self, *exc):
        if _nvtx:
            torch.cuda.nvtx.range_pop()
        self._record.__exit__(*exc)
        return False


def profiling_range(name: str):
    """A named range while profiling is on, else a shared no-op context manager."""
    return _Range(name) if _enabled and not torch.compiler.is_compiling() else _NULL


set_profiling(os.environ.get("FLASHLANE_PROFILE_RANGES", "") not in ("", "0"))

__all__ = ["RANGE_NAMES", "profiling_range", "set_profiling", "profiling_enabled"]
