"""Static-graph decode: the model's decode forward compiled once per batch-size bucket.

The CPU analogue of CUDA-graph capture sizes. A decode step of ``B`` sequences is padded to the
smallest bucket ``>= B`` (padding rows sit on the null page and the null state slot, see
``ForwardBatch.padded_decode``) and its block tables to a multiple of ``WIDTH_MULTIPLE`` pages;
the batch size is static in each graph, the table width is its one dynamic dimension, so
contexts can grow without a recompile. Steps with a prefill chunk, or more sequences than the
largest bucket, run eagerly. ``warm_up`` compiles every bucket before the first request;
Inductor's caches live under ``compile_cache_dir()`` so a second start mostly loads them.

Graph backends: ``torch.compile`` (Inductor) on CPU. On CUDA the same padded batches are what
CUDA-graph capture needs, and ``cuda_graph_mode`` switches Inductor to its CUDA-graph trees; the
models are not touched. That path is untested (no GPU was lent to the builds so far).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from ..kernels.backends import KernelBackend
from ..models.cache_tensors import CacheTensors
from ..models.forward_batch import ForwardBatch
from .engine_args import check_sizes

log = logging.getLogger("flashlane.engine")

WIDTH_MULTIPLE = 4          # block-table width padding (pages): fewer distinct shapes per graph
DEFAULT_SIZES = (1, 2, 4, 8, 16)


def compile_cache_dir() -> str:
    """Where Inductor keeps compiled kernels and graphs across runs: ``$FLASHLANE_CACHE/inductor``
    (default ``~/.cache/flashlane/inductor``; torch's default is a temp dir, lost on reboot),
    unless ``TORCHINDUCTOR_CACHE_DIR`` names another place."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return chosen
    root = os.environ.get("FLASHLANE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "flashlane")
    return os.path.join(root, "inductor")


def cuda_graph_mode(device: str) -> str | None:
    """The torch.compile mode for ``device``: on CUDA, Inductor's CUDA-graph trees
    ("reduce-overhead") replay each bucket's captured graph; the padded batches keep shapes and
    the cache's per-layer views keep addresses fixed, as capture needs. CPU: plain Inductor."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


@dataclass
class WarmUp:
    seconds: float
    sizes: tuple[int, ...]
    cache_dir: str


class CompiledDecode:
    """``run(batch) -> hidden`` through the compiled graph of the batch's bucket."""

    def __init__(self, model: torch.nn.Module, cache: CacheTensors, sizes, index_topk: int | None,
                 min_width: int = 1, mode: str | None = None, ops: KernelBackend | None = None):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir()
        self.model = model
        self.cache = cache
        self.sizes = check_sizes(sizes)
        self.index_topk = index_topk
        self.ops = ops              # one backend object for every batch: graphs are traced against it
        # two pages at least: the width is a dynamic dim, and torch specialises sizes 0 and 1
        self.min_width = max(2, min_width)
        # One compiled function; its graphs are cached per guard set: batch size 1 gets its own
        # graph (torch specialises size 1), sizes >= 2 share one with a symbolic batch size
        # unless a branch in the model specialises it (then one per bucket).
        self._graph = torch.compile(self._forward, dynamic=False, fullgraph=True, mode=mode)
        self.calls = {b: 0 for b in self.sizes}
        self._warmed = False

    @staticmethod
    def _forward(model: torch.nn.Module, batch: ForwardBatch) -> torch.Tensor:
        return model(batch)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences, or None (run eagerly)."""
        return next((b for b in self.sizes if b >= num_seqs), None)

    def width(self, max_pages: int) -> int:
        w = max(self.min_width, max_pages)
        return -(-w // WIDTH_MULTIPLE) * WIDTH_MULTIPLE

    def batch(self, tokens: list[int], positions: list[int], tables: list[list[int]],
              slots: list[int]) -> ForwardBatch:
        size = self.bucket(len(tokens))
        if size is None:
            raise ValueError(f"{len(tokens)} sequences exceed the largest compiled bucket {self.max_size}")
        width = self.width(max(len(t) for t in tables))
        return ForwardBatch.padded_decode(tokens, positions, tables, slots, self.cache, size, width,
                                          self.index_topk, ops=self.ops)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of every row of a padded batch (padding rows included)."""
        size = batch.state_slots.shape[0]
        torch._dynamo.maybe_mark_dynamic(batch.block_tables, 1)
        if size > 1:
            for t in (batch.input_ids, batch.positions, batch.cu_q, batch.ctx_lens_t, batch.block_tables,
                      batch.slot_mapping, batch.state_slots, batch.seq_of_token):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        self.calls[size] += 1
        with _no_duck_shapes:
            if self._warmed:
                try:
                    with _fast_guards():
                        return self._graph(self.model, batch)
                except RuntimeError as e:   # a shape no warm-up covered: compile it, guarded
                    if "Recompilation triggered" not in str(e):
                        raise
                    log.warning("compiled decode: recompiling for a new shape (batch %d, %d pages)", size,
                                batch.block_tables.shape[1])
            return self._graph(self.model, batch)

    @torch.inference_mode()
    def warm_up(self) -> WarmUp:
        """Compile every bucket (and the dynamic table width) on padding-only batches: they write
        only the null page and slot, so the cache is untouched."""
        start = time.monotonic()
        for size in self.sizes:
            for pages in (self.min_width, self.min_width + WIDTH_MULTIPLE):
                batch = ForwardBatch.padded_decode([], [], [], [], self.cache, size, self.width(pages),
                                                   self.index_topk, ops=self.ops)
                self.run(batch)
        self.calls = {b: 0 for b in self.sizes}
        self._warmed = True
        took = time.monotonic() - start
        return WarmUp(took, self.sizes, os.environ["TORCHINDUCTOR_CACHE_DIR"])


# equal batch size and table width must not become one symbol
_no_duck_shapes = torch.fx.experimental._config.patch(use_duck_shape=False)
# Guard checks cost ~1 ms a step (they cover every weight and cache view). Only the guards that
# tell this function's graphs apart are run: what else they check (the same weights, the same
# pool views, the same Python constants) is fixed for the engine's lifetime.
def _fast_guards():
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
