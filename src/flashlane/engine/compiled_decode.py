"""Static-graph decode: the model's decode forward compiled once per batch-size bucket.

The CPU analogue of CUDA-graph capture sizes. A decode step of ``B`` sequences is padded to the
smallest bucket ``>= B`` (padding rows sit on the null page and the null state slot, see
``ForwardBatch.padded_decode``) and its block tables to a multiple of ``WIDTH_MULTIPLE`` pages;
the batch size is static in each graph, the table width is its one dynamic dimension, so
contexts can grow without a recompile. Steps with a prefill chunk, or more sequences than the
largest bucket, run eagerly. ``warm_up`` compiles every bucket before the first request;
Inductor's caches live under ``compile_cache_dir()`` so a second start mostly loads them.

Regional compilation (the default): what is compiled is one decoder layer, not the model. One
compiled function runs every layer of the model; with ``inline_inbuilt_nn_modules`` (torch's
default) a layer's parameters are graph inputs, so all layers of one kind (mixer, FFN, indexer
full or shared) share one graph per bucket, and a cold start compiles a few layers' worth
instead of the whole stack. The embedding, the head and the glue between layers run eagerly.
Each layer sees its own pool views through ``_LayerCache``, which answers every row lookup with
0: the layer id is then never used inside the graph, so it is not guarded on (a guarded int
would mean one graph per layer). ``regional=False`` compiles the whole forward per bucket (the
earlier mechanism, kept for comparison and for models without a ``layer_call`` hook).

Speculative decoding: a verify step (each sequence's last token and its drafts) of a model
without per-sequence state runs through the decode graphs, one row per verified token (see
``ModelRunner._run_compiled``); a model with per-sequence state (KDA, pooled indexer tails) gets
graphs of its own for ``verify_rows`` tokens per sequence, whose stateful layers keep their state
after each token (``StepStates``), so a rollback copies the accepted one back. With MTP drafting (``mtp=True``) the MTP layer's
``draft`` is one more compiled region, run over padded decode batches.

Graph backends: ``torch.compile`` (Inductor) on CPU. On CUDA the same padded batches are what
CUDA-graph capture needs, and ``cuda_graph_mode`` switches Inductor to its CUDA-graph trees; the
models are not touched. That path is untested (no GPU was lent to the builds so far).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import threading
import time
import types
from dataclasses import dataclass

import torch

from ..kernels.backends import KernelBackend
from ..models.cache_tensors import CacheTensors
from ..models.forward_batch import ForwardBatch
from ..models.mtp import call_draft
from .cache.snapshots import StepStates
from .engine_args import check_sizes

log = logging.getLogger("flashlane.engine")

WIDTH_MULTIPLE = 4          # block-table width padding (pages): fewer distinct shapes per graph
DEFAULT_SIZES = (1, 2, 4, 8, 16)
# Inductor on CPU: its pass that emits a few-row matmul (the batch-1 decode graphs) as a fused
# multiply-and-sum kernel instead of a call into oneDNN / MKL, whose fixed cost per call (15-35 us)
# was a third of a tiny model's decode step. Its CPU limits: weights of at most 2048 x 2048, and
# FEW_ROWS rows where torch's default is 1, so that a one-sequence verify graph (1 + k rows, k <= 4)
# multiplies inside the graph too (tiny-flash, MTP k = 3 at c1: a step 11.2 -> 9.6 ms). The pass
# reads the limits from these options only when its module is first imported, and from its module
# constants at every match, so ``_raise_row_limit`` sets the constant; the limit in the options
# keeps cached graphs compiled under another limit apart (the options are in Inductor's cache key).
FEW_ROWS = 5
CPU_OPTIONS = {"post_grad_fusion_options": {"decompose_mm_pass": {"cpu_max_first_dimension_decomposition": FEW_ROWS}}}


def _raise_row_limit() -> None:
    """The decomposition pass's CPU row limit raised to FEW_ROWS (see CPU_OPTIONS), where this
    torch has it; batch dims marked dynamic are never decomposed, so the graphs of buckets >= 2
    keep aten's matmuls."""
    try:
        from torch._inductor.fx_passes import decompose_mem_bound_mm as mm_pass
    except ImportError:
        return
    if isinstance(getattr(mm_pass, "cpu_max_first_dimension_decomposition", None), int):
        mm_pass.cpu_max_first_dimension_decomposition = max(mm_pass.cpu_max_first_dimension_decomposition, FEW_ROWS)


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


def probe_vector_isas() -> list[threading.Thread] | None:
    """Start Inductor's probe of this CPU's vector ISAs on other threads, all at once.

    Inductor's first CPU kernel waits for it: a test build and load per ISA, one after another
    (11.5 s of a cold start on 2 cores, measured). Started before the first graph is traced, the
    builds run beside the tracing and one another; Inductor then finds the answers cached. Only
    a head start: where torch's private module differs, nothing is started and Inductor probes
    as it always does."""
    try:
        from torch._inductor import cpu_vec_isa

        present = set(cpu_vec_isa.x86_isa_checker())
        candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                      if all(flag in present for flag in str(isa).split())]
    except (ImportError, AttributeError):
        return None
    # a VecISA's truth value is its probe, cached on the ISA object Inductor asks later
    probes = [threading.Thread(target=bool, args=(isa,), daemon=True, name=f"probe-{isa}") for isa in candidates]
    for t in probes:
        t.start()
    return probes


@dataclass
class WarmUp:
    seconds: float
    sizes: tuple[int, ...]
    cache_dir: str
    mode: str = "regional"     # "regional" (one graph per layer kind) or "whole" (the full forward)
    graphs: int = 0            # compiled graphs after warm-up


class _ZeroRows:
    def __getitem__(self, layer_id: int) -> int:
        return 0


class _LayerCache:
    """One layer's pool views in the shape the layer code reads them (``CacheTensors``): its spec
    maps every layer id to row 0 and ``layer(name, 0)`` is this layer's view of pool ``name``;
    ``<pool>_steps`` are its per-token state buffers of a verify step (``StepStates``)."""

    def __init__(self, cache: CacheTensors, layer_id: int, steps: StepStates | None = None):
        spec = cache.spec
        rows: dict[str, int] = {}
        if layer_id in spec.latent_layers:
            rows.update(dict.fromkeys(("latent", "latent_scale"), spec.latent_row(layer_id)))
        if layer_id in spec.index_row_of:
            rows.update(dict.fromkeys(("index_keys", "index_keys_scale", "index_tail"), spec.index_row_of[layer_id]))
        if layer_id in spec.kda_layers:
            rows.update(dict.fromkeys(("conv", "recurrent"), spec.kda_row(layer_id)))
        self.views = {name: cache.layer(name, row) for name, row in rows.items()}
        if steps is not None:
            self.views.update(steps.views(rows))
        self.page_size = spec.page_size
        self.index_row_of = _ZeroRows()
        self.spec = self
        self.device = cache.device

    def latent_row(self, layer_id: int) -> int:
        return 0

    def kda_row(self, layer_id: int) -> int:
        return 0

    def index_row(self, layer_id: int) -> int:
        return 0

    def layer(self, name: str, row: int) -> torch.Tensor | None:
        return self.views.get(name)


def _call_region(layer: torch.nn.Module, x: torch.Tensor, batch: ForwardBatch, *extra):
    return layer(x, batch, *extra)


def _whole_forward(model: torch.nn.Module, batch: ForwardBatch) -> torch.Tensor:
    return model(batch)


def _mark_dynamic(value, size: int, history: int, rows: int, depth: int = 0) -> None:
    """Mark the batch dimensions (dim 0 of ``size`` sequences or ``rows`` tokens, when > 1) and
    history-length dimensions of the tensors a region is handed (hidden states, selections, an
    attention plan's gather rows and masks) dynamic, as ``run`` does for the batch's own
    tensors: one graph serves every bucket >= 2 and every table width."""
    if isinstance(value, torch.Tensor):
        if size > 1 and value.dim() and value.shape[0] in (size, rows):
            torch._dynamo.maybe_mark_dynamic(value, 0)
        # history dims only inside plan objects: a hidden width may equal it by chance
        for d in range(1, value.dim() if depth > 2 else 0):
            if value.shape[d] == history:
                torch._dynamo.maybe_mark_dynamic(value, d)
    elif depth < 5 and isinstance(value, (list, tuple)):
        for v in value:
            _mark_dynamic(v, size, history, rows, depth + 1)
    elif depth < 5 and hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
        for v in vars(value).values():
            _mark_dynamic(v, size, history, rows, depth + 1)


def _own_copy(fn):
    """``fn`` with a code object of its own: torch.compile keeps its graphs (and counts them
    against the recompile limit) per code object, so each CompiledDecode gets its own set."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)


def _layer_kind(layer: torch.nn.Module) -> tuple:
    """What tells layers apart for compilation: their module tree (mixer, FFN, indexer or not)."""
    return tuple((name, type(m).__name__) for name, m in layer.named_modules())


def supports_regional(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes a ``layer_call`` (see ``models.layers.call_layer``)."""
    return "layer_call" in inspect.signature(model.forward).parameters


class CompiledDecode:
    """``run(batch) -> hidden`` through the compiled graph of the batch's bucket."""

    def __init__(self, model: torch.nn.Module, cache: CacheTensors, sizes, index_topk: int | None,
                 min_width: int = 1, mode: str | None = None, ops: KernelBackend | None = None,
                 regional: bool = True, backend: str = "inductor", verify_rows: int = 1, mtp: bool = False,
                 mtp_rows: tuple[int, ...] = (), hidden: tuple[int, torch.dtype] | None = None):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = compile_cache_dir()
        self.model = model
        self.cache = cache
        self.sizes = check_sizes(sizes)
        self.index_topk = index_topk
        self.ops = ops              # one backend object for every batch: graphs are traced against it
        # two pages at least: the width is a dynamic dim, and torch specialises sizes 0 and 1
        self.min_width = max(2, min_width)
        self.regional = regional and supports_regional(model)
        # One compiled function; its graphs are cached per guard set: batch size 1 gets its own
        # graph (torch specialises size 1), sizes >= 2 share one with a symbolic batch size
        # unless a branch in the model specialises it (then one per bucket); regionally, that
        # per layer kind.
        self._mode, self._backend = mode, backend   # backend: "eager" only in tests (guards without Inductor)
        # regional: one compiled function per layer kind (see _layer_kind); whole: one in all
        self._graphs: dict[tuple, tuple] = {}
        self._layers: dict[int, tuple[_LayerCache, tuple]] = {}   # id(layer) -> (its views, its compiled fn)
        if not self.regional:
            self._whole = self._compiled(())
        self.calls = {b: 0 for b in self.sizes}
        self.draft_calls = 0        # MTP layer passes through its region (``draft``)
        self.mtp = mtp and self.regional
        # tokens per sequence of the MTP layer's catch-up graphs (a layer with per-sequence state
        # takes a multi-token catch-up in order: one graph per count)
        self.mtp_rows = tuple(mtp_rows) if self.mtp else ()
        self._warmed = False
        # Speculative verify steps of a model with per-sequence state (regional only): graphs for
        # ``verify_rows`` tokens per sequence, the stateful layers' state after each token but the
        # last kept for every sequence of the largest bucket, for the rollback's copy.
        self.verify_rows = verify_rows if self.regional else 1
        if (self.verify_rows > 1 or self.mtp) and hidden is None:
            raise ValueError("verify graphs and the MTP region need hidden=(hidden size, activation dtype)")
        self.hidden = hidden       # (width, dtype) of the hidden states: MTP warm-up
        self.step_states = StepStates(cache, self.max_size, self.verify_rows - 1) if self.verify_rows > 1 else None

    @property
    def mode_name(self) -> str:
        return "regional" if self.regional else "whole"

    @property
    def num_kinds(self) -> int:
        """Compiled functions: the layer kinds met so far (1 for the whole forward)."""
        return len(self._graphs)

    def graphs_per_kind(self) -> dict[tuple, int]:
        """Graphs compiled so far per compiled function (one per guard set)."""
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list
        return {kind: len(entries(fn.__code__)) for kind, (fn, _) in self._graphs.items()}

    @property
    def num_graphs(self) -> int:
        return sum(self.graphs_per_kind().values())

    def _compiled(self, kind: tuple, region=None) -> tuple:
        """(plain function, its compiled form) for ``kind``, each kind with a code object of its
        own: torch.compile keeps graphs per code object, and a guard set that differs between
        layer kinds in which submodules exist cannot be told apart by the cheap guard check."""
        if kind not in self._graphs:
            fn = _own_copy(region or (_call_region if self.regional else _whole_forward))
            options = None if self._mode is not None or self._backend != "inductor" else CPU_OPTIONS
            if options is not None:
                _raise_row_limit()
            self._graphs[kind] = (fn, torch.compile(fn, dynamic=False, fullgraph=True, mode=self._mode,
                                                        backend=self._backend, options=options))
        return self._graphs[kind]

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

    def batch_rows(self, tokens: list[list[int]], starts: list[int], tables: list[list[int]],
                   slots: list[int]) -> ForwardBatch:
        """Sequences' new tokens as decode rows, one per token (token j of a sequence at position
        ``starts[b] + j``, with the sequence's block table and slot): each row writes its own
        cache row before attending up to its position, so row j sees rows 0..j of the same
        batch. Exact only for layers without per-sequence state."""
        ids, positions, row_tables, row_slots = [], [], [], []
        for toks, start, table, slot in zip(tokens, starts, tables, slots):
            ids += toks
            positions += range(start, start + len(toks))
            row_tables += [table] * len(toks)
            row_slots += [slot] * len(toks)
        return self.batch(ids, positions, row_tables, row_slots)

    def batch_verify(self, tokens: list[list[int]], starts: list[int], tables: list[list[int]],
                     slots: list[int], q: int | None = None) -> ForwardBatch:
        """``q`` tokens per sequence (default ``verify_rows``: a verify step, each sequence's last
        token and its drafts; the MTP layer's catch-up over ``q`` committed tokens)."""
        q = q or self.verify_rows
        size = self.bucket(len(tokens))
        if size is None or q < 2:
            raise ValueError(f"{len(tokens)} sequences of {q} tokens do not fit a compiled step (buckets {self.sizes})")
        # the table covers every row's position, padding tokens included: past a sequence's own
        # pages the table holds the null page, so their rows never land on a page in use
        page = self.cache.spec.page_size
        width = self.width(max(max(len(t), (c + q - 1) // page + 1) for t, c in zip(tables, starts)))
        return ForwardBatch.padded_verify(tokens, starts, tables, slots, self.cache, size, width, q,
                                          self.index_topk, ops=self.ops)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of every row of a padded batch (padding rows included)."""
        size = self._mark_batch(batch)
        self.calls[size] += 1
        if self.regional:
            return self.model(batch, layer_call=self._layer_call)
        return self._guarded(self._whole[1], self.model, batch)

    def draft(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The model's MTP layer over a padded batch through its compiled region (``mtp=True``):
        decode rows, or ``mtp_rows`` tokens per sequence. ``hidden``: the real rows' inputs
        (padded here); returns the real rows' outputs."""
        if not self.mtp:
            raise RuntimeError("this compiled decode was built without the MTP layer's region")
        self._mark_batch(batch)
        self.draft_calls += 1
        rows, pad = hidden.shape[0], batch.input_ids.shape[0] - hidden.shape[0]
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
        return self.model.mtp(batch, hidden, draft_call=self._draft_call)[:rows]

    @staticmethod
    def _mark_batch(batch: ForwardBatch) -> int:
        """Mark the batch's sequence / row dimensions and table width dynamic; its bucket size."""
        size = batch.state_slots.shape[0]
        torch._dynamo.maybe_mark_dynamic(batch.block_tables, 1)
        if size > 1:
            for t in (batch.input_ids, batch.positions, batch.cu_q, batch.ctx_lens_t, batch.block_tables,
                      batch.slot_mapping, batch.state_slots, batch.seq_of_token):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return size

    def _guarded(self, graph, *args):
        with _no_duck_shapes:
            if self._warmed:
                try:
                    with _fast_guards():
                        return graph(*args)
                except RuntimeError as e:   # a shape no warm-up covered: compile it, guarded
                    if "Recompilation triggered" not in str(e):
                        raise
                    batch = next(a for a in args if isinstance(a, ForwardBatch))
                    log.warning("compiled decode: recompiling for a new shape (batch %d, %d pages)",
                                batch.state_slots.shape[0], batch.block_tables.shape[1])
            with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
                return graph(*args)

    def _layer_call(self, layer: torch.nn.Module, x: torch.Tensor, batch: ForwardBatch, *extra):
        """Run one decoder layer through the compiled region, on a batch whose cache is the
        layer's own views (see ``_LayerCache``)."""
        known = self._layers.get(id(layer))
        if known is None:
            layer_id = layer.self_attn.layer_id
            known = self._layers[id(layer)] = (_LayerCache(self.cache, layer_id, self.step_states),
                                               self._compiled(_layer_kind(layer)))
        local, (_, graph) = known
        history = batch.block_tables.shape[1] * batch.page_size
        _mark_dynamic((x, extra), batch.state_slots.shape[0], history, batch.input_ids.shape[0])
        return self._guarded(graph, layer, x, dataclasses.replace(batch, cache=local), *extra)

    def _draft_call(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module, batch: ForwardBatch,
                    hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's ``draft`` through a compiled region of its own kind (as ``_layer_call``)."""
        known = self._layers.get(id(layer))
        if known is None:
            known = self._layers[id(layer)] = (_LayerCache(self.cache, layer.self_attn.layer_id),
                                               self._compiled(("draft",) + _layer_kind(layer), call_draft))
        local, (_, graph) = known
        history = batch.block_tables.shape[1] * batch.page_size
        _mark_dynamic((hidden,), batch.state_slots.shape[0], history, batch.input_ids.shape[0])
        return self._guarded(graph, layer, embed_tokens, dataclasses.replace(batch, cache=local), hidden)

    @torch.inference_mode()
    def warm_up(self) -> WarmUp:
        """Compile every bucket (and the dynamic table width) on padding-only batches: they write
        only the null page and slot, so the cache is untouched."""
        start = time.monotonic()
        if self._backend == "inductor" and self.cache.device.type == "cpu":
            probe_vector_isas()
        for size in self.sizes:
            for pages in (self.min_width, self.min_width + WIDTH_MULTIPLE):
                batch = ForwardBatch.padded_decode([], [], [], [], self.cache, size, self.width(pages),
                                                   self.index_topk, ops=self.ops)
                self.run(batch)
                if self.verify_rows > 1:
                    self.run(ForwardBatch.padded_verify([], [], [], [], self.cache, size, self.width(pages),
                                                        self.verify_rows, self.index_topk, ops=self.ops))
                if self.mtp:
                    nothing = torch.zeros(0, self.hidden[0], dtype=self.hidden[1], device=self.cache.device)
                    self.draft(batch, nothing)
                    for q in self.mtp_rows:
                        self.draft(ForwardBatch.padded_verify([], [], [], [], self.cache, size, self.width(pages), q,
                                                              self.index_topk, ops=self.ops), nothing)
        self.calls = {b: 0 for b in self.sizes}
        self.draft_calls = 0
        self._warmed = True
        took = time.monotonic() - start
        return WarmUp(took, self.sizes, os.environ["TORCHINDUCTOR_CACHE_DIR"], self.mode_name, self.num_graphs)


# graphs one compiled function may hold: layer kinds x buckets x width specialisations, with room
_RECOMPILE_LIMIT = 64


# equal batch size and table width must not become one symbol
_no_duck_shapes = torch.fx.experimental._config.patch(use_duck_shape=False)
# Guard checks cost ~1 ms a step (they cover every weight and cache view). Only the guards that
# tell this function's graphs apart are run: what else they check (the same weights, the same
# pool views, the same Python constants) is fixed for the engine's lifetime.
def _fast_guards():
    return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
