"""The time of one engine step of a full-size model on named GPUs, with tensor and expert
parallelism as costs; torch-free, stated assumptions instead of a fit.

One engine replica of ``devices`` GPUs: attention (and every non-expert weight) is split ``tp``
ways over all of them (tp = devices), routed experts over ``ep`` groups (ep = 1: every device holds
every expert, sharded tp ways like a dense FFN). The layout is ``memory``'s (dp = 1). Per device:

    t_step = host.step_s + host.per_seq_s * seqs + gpu + comm + dispatch
    gpu    = sum over op groups g of max(flops_g / (peak_g * mfu), bytes_g / (mem_bw * mbu))
    comm   = all-reduces (tp > 1) + expert all-to-alls (ep > 1)
    dispatch, a decode step replayed from a CUDA graph:  kernels * graph_replay_s
    dispatch, an eager step:  max(0, kernels * kernel_launch_s - gpu - comm)

The groups' whole-model FLOPs and bytes are ``step_cost.StepWork``'s (checked against it when the
model is built), split per device as the layout says: FLOPs of weights, attention, recurrence and
head / tp, routed-expert FLOPs / devices; weight bytes / tp except the replicated norms, mHC and
routers; routed-expert bytes = distinct experts touched / devices (uniform routing: each of the ep
groups holds 1/ep of the experts, sharded devices/ep ways); MLA latent and indexer-key bytes not
split (replicated within the tp group: each rank reads every row it attends for its 1/tp of the
heads); KDA state / tp. Weights and experts run at the weight dtype's peak, attention, recurrence
and the LM head (bf16 in FP8 checkpoints) at bf16's.

Eager steps: the host launches kernels while the GPU runs them, so the step waits for launches
only when they take longer than the GPU work (collectives included: they are kernels too). A step
with a prefill chunk always runs eagerly (vLLM and SGLang capture decode batches only), and so does
a decode batch larger than the largest captured one.

Expert parallelism costs a DeepEP-style dispatch and combine per MoE layer, each rank sending its
share of the step's tokens; it changes no expert FLOPs or bytes per device (uniform routing).

Speculative decoding: a verify step's ``1 + d`` tokens per sequence are decode rows at
consecutive positions (graphs) or a chunk (eager), every row with logits (``StepWork``); the MTP
drafter's calls are the ``draft`` group (the MTP layer's weights and routed experts read once per
call, sharded like the trunk's: / tp) plus one MTP layer's and the LM head's kernels per call,
replayed from a graph with the step's decode batch or launched. The draft pass adds no host time
(it runs inside the step's, as SGLang's and vLLM's MTP drafting does) and no all-reduces.

Not modelled: overlap of communication with compute, data-parallel attention, pipeline
parallelism, prefill/decode disaggregation, expert load imbalance
(the busiest device of an ep group), memory capacity (``memory.device_memory`` says what fits),
and kernel counts that differ between prefill and decode. Simplified: mHC and router FLOPs are
split tp ways with the other weights (they are replicated; about 1% of the group), and Flash's
bf16 KDA / indexer projections run at the fp8 peak in an fp8 model. Cache bytes are StepWork's:
a prefill chunk reads each visible indexer key once (one scoring matmul for the chunk), and every
query reads each latent row it attends (no reuse of a gathered row across the queries of a chunk).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

from .cache import KV_FORMATS, index_entry_bytes, latent_row_bytes
from .flops import attended_positions, decode_flops, prefill_flops, scored_keys, sum_attended, sum_scored
from .hardware import HARDWARE, Hardware, hardware_names
from .memory import REPLICATED, component_bytes
from .params import count_params
from .step_cost import GROUPS, GroupWork, StepShape, StepWork

ACTIVATION_BYTES = 2          # bf16 activations in all-reduces and the expert combine
GRAPH_MAX_BATCH = 512         # largest captured decode batch (vLLM's default capture sizes go up to 512)
# kernels of one layer, by layer kind, in a fused serving stack (eager launches; a captured graph
# replays the same nodes). Counted from each kind's op sequence; estimates until profiled on a GPU.
KERNELS_PER_LAYER = {
    "kda": 14,            # norm, fused q/k/v proj, short conv, f_a, f_b, beta, g_a, g_b, KDA kernel (3),
                          # gated norm, o_proj, add
    "dsa_indexer": 21,    # MLA (13: norm, q_a, q norm, q_b, kv_a, kv norm, rope, cache write, q absorb,
                          # sparse attention, v up, o_proj, add) + its indexer (8: wq_b, wk, k norm,
                          # weights proj, rope, key write, scoring, top-k)
    "dsa_shared": 13,     # MLA reusing another layer's index selection (IndexCache sharing)
    "attn": 7,            # norm, qkv, rope, cache write, attention, o_proj, add
    "moe": 12,            # norm, router, top-k, shared expert (3), grouped experts (align, gate_up, act,
                          # down, combine), add
    "dense_ffn": 5,       # norm, gate_up, act, down, add
    "mhc": 8,             # glm5_next: two hyper-connection sites, 4 kernels each
}
KERNELS_PER_STEP = 6      # embedding, final norm, LM head, logits processing, sampling (2)
# one MTP drafter call: enorm, hnorm, eh_proj (with the concat), its DSA layer with an indexer, its
# MoE, shared_head.norm, the LM head and argmax
KERNELS_PER_DRAFT_CALL = 3 + KERNELS_PER_LAYER["dsa_indexer"] + KERNELS_PER_LAYER["moe"] + 3
KERNELS_SOURCE = ("estimate: counted from the op sequence of each layer kind in a fused serving stack "
                  "(vLLM / SGLang style: fused projections, one grouped-GEMM MoE, varlen attention and KDA "
                  "kernels); profile a step on a GPU (nsys) to replace it")
# two prefill chunks (one after a cached prefix) and decode rows short of and past the top-k: every term
_PROBE = StepShape(prefill=((300, 5000), (17, 0)), decode=(0, 70, 3000, 130_000), verify=((3, 900),),
                   draft_calls=3, draft_rows=9, draft_logit_rows=7)


def parse_hardware_spec(spec: str) -> tuple[Hardware, int]:
    """"h200x8" / "H200x8" / "h100" (one device) / "mi355xx4" -> (profile, device count)."""
    known = [n for n in hardware_names() if n != "local"]
    error = ValueError(f"--hardware {spec!r}: expected NAME or NAMExCOUNT (COUNT >= 1) with NAME one of "
                       f"{', '.join(known)}")
    key = str(spec).strip().lower().replace("-", "").replace(" ", "")
    if key in HARDWARE:
        return HARDWARE[key], 1
    name, sep, count = key.rpartition("x")
    if not sep or name not in HARDWARE or not count.isdigit() or int(count) < 1:
        raise error
    return HARDWARE[name], int(count)


@dataclass(frozen=True)
class ParallelLayout:
    """One replica: attention split ``tp`` ways over all ``devices``; routed experts over ``ep``
    groups (ep = 1: every device holds every expert, sharded tp ways)."""

    devices: int
    tp: int
    ep: int = 1

    def __post_init__(self):
        for name in ("devices", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be an integer >= 1, got {value!r}")
        if self.tp != self.devices:
            raise ValueError(f"ParallelLayout.tp ({self.tp}) must equal devices ({self.devices}): the replica's "
                             "attention is split tp ways over all its devices (data-parallel attention is not "
                             "modelled)")
        if self.devices % self.ep:
            raise ValueError(f"ParallelLayout.ep ({self.ep}) must divide devices ({self.devices}) (so ep <= devices)")


@dataclass(frozen=True)
class HostAssumptions:
    """Engine host time per step and per scheduled sequence, serial with the GPU work. Kernel
    launches are not here (they overlap the GPU; see ``HardwareStepCost``)."""

    step_s: float = 2e-3
    per_seq_s: float = 20e-6
    step_source: str = ("estimate, not measured: per-step host time of a Python engine loop (scheduling, batch "
                        "metadata, sampling and output bookkeeping), a few ms — the CPU overhead vLLM's V1 engine "
                        "was rewritten to cut; fit on a GPU to replace it")
    per_seq_source: str = ("estimate, not measured: host time per scheduled sequence (its metadata row, block "
                           "table, sampling parameters, output token), tens of microseconds in Python; fit on a "
                           "GPU to replace it")

    def __post_init__(self):
        for name in ("step_s", "per_seq_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"HostAssumptions.{name} must be finite and >= 0, got {value!r}")

    def scaled(self, factor: float) -> "HostAssumptions":
        return replace(self, step_s=self.step_s * factor, per_seq_s=self.per_seq_s * factor)


@dataclass(frozen=True)
class CommAssumptions:
    """Fixed latency of one collective; its bandwidth part comes from the profile's interconnect."""

    all_reduce_latency_s: float = 10e-6
    all_to_all_latency_s: float = 20e-6
    all_reduce_source: str = ("estimate, not measured: a small-message all-reduce within one NVLink node takes "
                              "about 10 us with NCCL (custom all-reduce kernels of vLLM / SGLang are faster); "
                              "fit on a GPU to replace it")
    all_to_all_source: str = ("estimate, not measured: fixed cost of one expert-parallel dispatch or combine "
                              "within one node (DeepEP-style kernels), a few tens of us; fit on a GPU to replace it")

    def __post_init__(self):
        for name in ("all_reduce_latency_s", "all_to_all_latency_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"CommAssumptions.{name} must be finite and >= 0, got {value!r}")

    def scaled(self, factor: float) -> "CommAssumptions":
        return replace(self, all_reduce_latency_s=self.all_reduce_latency_s * factor,
                       all_to_all_latency_s=self.all_to_all_latency_s * factor)


def _attention_flop_rates(cfg) -> tuple[float, float, float]:
    """FLOPs (all layers) per DSA position attended, per indexer key scored and per dense-attention
    key, read off ``flops.decode_flops``, which is linear in those three counts."""
    n_dsa, n_attn = cfg.mixer_types.count("dsa"), cfg.mixer_types.count("attn")
    pool = max(cfg.index_kpool, 1)
    # contexts past the top-k, where a DSA query attends fewer positions than it sees
    t1, t2 = 2 * cfg.index_topk + 3 * pool + 1, 4 * cfg.index_topk + 5 * pool + 3
    f1, f2 = decode_flops(cfg, t1), decode_flops(cfg, t2)
    per_key = f2.indexer_scoring / scored_keys(cfg, t2)
    a1, a2 = attended_positions(cfg, t1), attended_positions(cfg, t2)
    s1, s2 = f1.sparse_attention, f2.sparse_attention
    if not n_dsa or not a2:
        return 0.0, per_key, s2 / t2
    if not n_attn:
        return s2 / a2, per_key, 0.0
    det = a1 * t2 - a2 * t1
    return (s1 * t2 - s2 * t1) / det, per_key, (a1 * s2 - a2 * s1) / det


class HardwareStepCost:
    """``work`` on ``layout.devices`` GPUs of profile ``hw`` (see the module docstring).

    ``graphs``: decode-only steps of up to ``graph_max_batch`` sequences replay a CUDA graph.
    ``fused_kernels`` (default): a fixed number of kernels per layer whatever the sequences and
    experts (varlen mixers, grouped-GEMM MoE); False adds ``StepWork.op_counts`` (one dispatch per
    prefill sequence per layer, four per distinct routed expert per MoE layer), as flashlane's
    plain-torch kernels issue them."""

    TERMS = ("host_step", "host_seqs") + GROUPS + ("all_reduce", "all_to_all", "dispatch")
    SCALABLE = ("mfu", "mbu", "interconnect_bw", "kernel_launch_s", "graph_replay_s", "host", "collective_latency")

    def __init__(self, work: StepWork, hw: Hardware, layout: ParallelLayout, graphs: bool,
                 host: HostAssumptions = HostAssumptions(), weight_dtype: str = "fp8", mfu: float | None = None,
                 mbu: float | None = None, *, comm: CommAssumptions = CommAssumptions(),
                 fused_kernels: bool = True, graph_max_batch: int = GRAPH_MAX_BATCH):
        if weight_dtype not in ("fp8", "bf16"):
            raise ValueError(f"weight_dtype must be fp8 or bf16, got {weight_dtype!r}")
        self.mfu = self._efficiency("mfu", mfu, hw)
        self.mbu = self._efficiency("mbu", mbu, hw)
        for name in ("kernel_launch_s", "graph_replay_s") + (("interconnect_bw",) if layout.devices > 1 else ()):
            if getattr(hw, name) is None:
                raise ValueError(f"hardware {hw.name}: the profile states no {name}, which this model needs")
        if graph_max_batch < 1:
            raise ValueError(f"graph_max_batch must be >= 1, got {graph_max_batch}")
        cfg = work.cfg
        if work.graphs != bool(graphs):     # verified drafts run as the steps do: graph rows or a chunk
            work = copy.copy(work)
            work.graphs = bool(graphs)
        if layout.ep > 1 and cfg.n_routed_experts % layout.ep:
            raise ValueError(f"ParallelLayout.ep ({layout.ep}) must divide the model's {cfg.n_routed_experts} "
                             "routed experts")
        self.work, self.hw, self.layout, self.graphs = work, hw, layout, bool(graphs)
        self.host, self.comm, self.weight_dtype = host, comm, weight_dtype
        self.fused_kernels, self.graph_max_batch = bool(fused_kernels), int(graph_max_batch)
        self.cfg = work.cfg
        self._scaled: dict[str, float] = {}     # assumption -> factor, for the sources (``scaled``)
        self._init_work(work, weight_dtype)
        self._init_device()
        self._init_kernels()
        self._init_comm()

    @staticmethod
    def _efficiency(name: str, given: float | None, hw: Hardware) -> float:
        value = hw.efficiency.get(name) if given is None else given
        if value is None:
            raise ValueError(f"hardware {hw.name} states no {name}: pass {name}=")
        if not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value}")
        return float(value)

    # ---- whole-model work, as StepWork prices it, in closed form ------------------------------
    def _init_work(self, work: StepWork, weight_dtype: str) -> None:
        cfg = self.cfg
        one, two = work.groups(StepShape(decode=(0,))), work.groups(StepShape(decode=(0, 0)))
        # weights, experts and head are linear in tokens (or rows with logits): two probes suffice
        self._weight_flops = one["weights"].flops
        self._embed_row_bytes = two["weights"].bytes - one["weights"].bytes
        self._fixed_bytes = one["weights"].bytes - self._embed_row_bytes
        self._expert_flops = one["experts"].flops
        # bytes of one distinct expert in every MoE layer
        self._expert_bytes_all_layers = (one["experts"].bytes / work.distinct_experts(1)
                                         if cfg.n_routed_experts else 0.0)
        self._head_flops, self._head_bytes = one["head"].flops, one["head"].bytes
        self._state_rw = one["recurrence"].bytes
        self._rec_decode = decode_flops(cfg, 1).kda_recurrence
        self._rec_prefill = prefill_flops(cfg, 1, 0).kda_recurrence          # per new token
        self._f_pos, self._f_key, self._f_dense = _attention_flop_rates(cfg)
        self._n_dsa, self._n_attn = cfg.mixer_types.count("dsa"), cfg.mixer_types.count("attn")
        self._n_full, self._n_kda = len(cfg.full_indexer_layers), cfg.mixer_types.count("kda")
        self._n_moe = cfg.ffn_types.count("moe")

        comp = component_bytes(cfg, count_params(cfg), weight_dtype)
        fixed = sum(v for k, v in comp.items() if k not in ("head", "embedding", "routed_experts", "mtp"))
        if not math.isclose(fixed, self._fixed_bytes, rel_tol=1e-9):
            raise ValueError(f"weight_dtype {weight_dtype!r} is not the weight dtype the StepWork was built for")
        self._replicated_bytes = sum(comp[k] for k in REPLICATED)

        # StepWork does not say its kv dtype: find the cache formats whose row sizes give its bytes
        want = work.groups(_PROBE)

        def prices_like_work(fmt: str) -> bool:
            self._set_cache_rows(fmt)
            return math.isclose(self._whole_work(_PROBE)["attention"].bytes, want["attention"].bytes, rel_tol=1e-12)

        formats = [fmt for fmt in KV_FORMATS if prices_like_work(fmt)]
        if not formats:
            raise ValueError("the StepWork's cache bytes match no kv dtype of analyze.cache")
        self.kv_dtype = " / ".join(formats)   # formats with equal row sizes price the same
        self._set_cache_rows(formats[0])
        mine = self._whole_work(_PROBE)
        for g in GROUPS:   # the closed form must be StepWork, term for term
            for part in ("flops", "bytes"):
                a, b = getattr(mine[g], part), getattr(want[g], part)
                if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6):
                    raise RuntimeError(f"gpu_step_cost's {g} {part} ({a}) disagree with StepWork's ({b}): update "
                                       "the closed form to the changed work model")

    def _set_cache_rows(self, fmt: str) -> None:
        cfg = self.cfg
        latent = latent_row_bytes(cfg, fmt) if self._n_dsa + self._n_attn else 0.0
        index = index_entry_bytes(cfg, fmt) if self._n_full else 0.0
        self._b_pos, self._b_dense, self._b_key = self._n_dsa * latent, self._n_attn * latent, self._n_full * index
        self._b_write = (self._n_dsa + self._n_attn) * latent + self._n_full * index / max(cfg.index_kpool, 1)

    def _whole(self, shape: StepShape) -> tuple[float, ...]:
        """Whole-model (flops, bytes) of weights, experts, attention, recurrence, head, draft, then
        tokens, seqs."""
        cfg = self.cfg
        attended = scored = keys_read = dense_keys = dense_rows = prefill_tokens = 0
        chunks, decode = self.work.attention_parts(shape)
        for new, cached in chunks:
            end = cached + new
            prefill_tokens += new
            attended += sum_attended(cfg, end) - sum_attended(cfg, cached)
            scored += sum_scored(cfg, end) - sum_scored(cfg, cached)
            keys_read += scored_keys(cfg, end)                            # one score matmul per chunk
            dense_keys += (end * (end + 1) - cached * (cached + 1)) // 2   # keys summed over the chunk's queries
            dense_rows += end                                            # a tiled kernel reads each once
        if decode:
            if self._n_dsa:
                attended += sum(attended_positions(cfg, c + 1) for c in decode)
            if self._n_full:
                decode_keys = sum(scored_keys(cfg, c + 1) for c in decode)
                scored += decode_keys
                keys_read += decode_keys
            visible = sum(decode) + len(decode)
            dense_keys += visible
            dense_rows += visible
        tokens, seqs = prefill_tokens + len(decode), shape.num_seqs
        logit_rows = len(shape.prefill) + len(shape.decode) + sum(1 + d for d, _ in shape.verify)
        draft = self.work.draft(shape)
        return (
            tokens * self._weight_flops, self._fixed_bytes + tokens * self._embed_row_bytes,
            tokens * self._expert_flops, self.work.distinct_experts(tokens) * self._expert_bytes_all_layers,
            self._f_pos * attended + self._f_key * scored + self._f_dense * dense_keys,
            (self._b_pos * attended + self._b_dense * dense_rows + self._b_key * keys_read + self._b_write * tokens),
            self._rec_decode * len(decode) + self._rec_prefill * prefill_tokens,
            seqs * self._state_rw if self._n_kda else 0.0,
            logit_rows * self._head_flops, self._head_bytes,
            draft.flops, draft.bytes,
            tokens, seqs,
        )

    def _whole_work(self, shape: StepShape) -> dict[str, GroupWork]:
        w = self._whole(shape)
        return {g: GroupWork(w[2 * i], w[2 * i + 1]) for i, g in enumerate(GROUPS)}

    # ---- per device --------------------------------------------------------------------------
    def _init_device(self) -> None:
        hw, lay = self.hw, self.layout
        tp, devices = lay.tp, lay.devices
        # (flops share, bytes share, bytes added) per group on one device, in GROUPS order
        self._flops_share = (1 / tp, 1 / devices, 1 / tp, 1 / tp, 1 / tp, 1 / tp)
        self._bytes_share = (1 / tp, 1 / devices, 1.0, 1 / tp, 1 / tp, 1 / tp)
        self._bytes_added = (self._replicated_bytes * (1 - 1 / tp), 0.0, 0.0, 0.0, 0.0, 0.0)
        self.peak_dtype = {"weights": self.weight_dtype, "experts": self.weight_dtype, "attention": "bf16",
                           "recurrence": "bf16", "head": "bf16", "draft": self.weight_dtype}
        self._s_per_flop = tuple(1 / (hw.peak(self.peak_dtype[g]) * self.mfu) for g in GROUPS)
        self._s_per_byte = 1 / (hw.mem_bw * self.mbu)

    def device_work(self, shape: StepShape) -> dict[str, GroupWork]:
        """FLOPs and bytes of each op group on one device of the replica."""
        w = self._whole(shape)
        return {g: GroupWork(w[2 * i] * self._flops_share[i],
                             w[2 * i + 1] * self._bytes_share[i] + self._bytes_added[i])
                for i, g in enumerate(GROUPS)}

    # ---- communication and dispatch ----------------------------------------------------------
    def _init_comm(self) -> None:
        cfg, lay, bw = self.cfg, self.layout, self.hw.interconnect_bw
        self._all_reduces = 2 * cfg.num_layers if lay.tp > 1 else 0   # after the mixer and after the FFN
        # ring all-reduce: each device sends and receives 2 (tp-1)/tp of the message
        self._all_reduce_s_per_token = (2 * (lay.tp - 1) / lay.tp * cfg.hidden_size * ACTIVATION_BYTES / bw
                                        if self._all_reduces else 0.0)
        self._all_to_alls = 2 * self._n_moe if lay.ep > 1 else 0      # dispatch and combine per MoE layer
        self.dispatch_bytes = 1 if self.weight_dtype == "fp8" else ACTIVATION_BYTES
        # DeepEP style: each rank dispatches its 1/devices share of the step's tokens (so no token is
        # sent twice), the copies bound for the other ep groups ((ep-1)/ep of its top-k), and takes
        # the results back; seconds per token of the step, all MoE layers, dispatch and combine
        self._all_to_all_s_per_token = (
            self._n_moe * cfg.num_experts_per_tok * cfg.hidden_size * (self.dispatch_bytes + ACTIVATION_BYTES)
            * (lay.ep - 1) / lay.ep / lay.devices / bw if self._all_to_alls else 0.0)

    def _init_kernels(self) -> None:
        cfg, k = self.cfg, KERNELS_PER_LAYER
        n_dense = cfg.ffn_types.count("dense")
        self.kernels_by_kind = {
            "step": KERNELS_PER_STEP,
            "kda": self._n_kda * k["kda"],
            "dsa_indexer": self._n_full * k["dsa_indexer"],
            "dsa_shared": (self._n_dsa - self._n_full) * k["dsa_shared"],
            "attn": self._n_attn * k["attn"],
            "moe": self._n_moe * k["moe"],
            "dense_ffn": n_dense * k["dense_ffn"],
            "mhc": cfg.num_layers * k["mhc"] if cfg.arch == "glm5_next" else 0,
            "all_reduce": 2 * cfg.num_layers if self.layout.tp > 1 else 0,
            "all_to_all": 2 * self._n_moe if self.layout.ep > 1 else 0,
        }
        self.fixed_kernels = sum(self.kernels_by_kind.values())

    def kernels(self, shape: StepShape) -> float:
        drafting = shape.draft_calls * KERNELS_PER_DRAFT_CALL
        if self.fused_kernels:
            return float(self.fixed_kernels + drafting)
        per_seq_layer, per_expert = self.work.op_counts(shape)
        return self.fixed_kernels + drafting + per_seq_layer + per_expert

    def replays_graph(self, shape: StepShape) -> bool:
        chunks, rows = self.work.attention_parts(shape)
        return self.graphs and not chunks and len(rows) <= self.graph_max_batch

    # ---- the step ----------------------------------------------------------------------------
    def _terms(self, shape: StepShape) -> tuple[float, ...]:
        w = self._whole(shape)
        tokens, seqs = w[2 * len(GROUPS)], w[2 * len(GROUPS) + 1]
        fs, bs, add = self._flops_share, self._bytes_share, self._bytes_added
        spf, spb = self._s_per_flop, self._s_per_byte
        groups = tuple(max(w[2 * i] * fs[i] * spf[i], (w[2 * i + 1] * bs[i] + add[i]) * spb)
                       for i in range(len(GROUPS)))
        all_reduce = self._all_reduces * (self.comm.all_reduce_latency_s + tokens * self._all_reduce_s_per_token)
        all_to_all = self._all_to_alls * self.comm.all_to_all_latency_s + tokens * self._all_to_all_s_per_token
        kernels = self.kernels(shape)
        if self.replays_graph(shape):
            dispatch = kernels * self.hw.graph_replay_s
        else:
            dispatch = max(0.0, kernels * self.hw.kernel_launch_s - sum(groups) - all_reduce - all_to_all)
        return (self.host.step_s, self.host.per_seq_s * seqs, *groups, all_reduce, all_to_all, dispatch)

    def seconds(self, shape: StepShape) -> float:
        return sum(self._terms(shape))

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        """Seconds of each term (they sum to ``seconds``): host, each op group's max(compute,
        memory), the collectives, and dispatch (graph replay, or eager launches the GPU waits for)."""
        return dict(zip(self.TERMS, self._terms(shape)))

    # ---- what it assumes ---------------------------------------------------------------------
    def scaled(self, **factors: float) -> "HardwareStepCost":
        """A copy with named assumptions multiplied (``SCALABLE``); mfu and mbu stop at 1."""
        unknown = sorted(set(factors) - set(self.SCALABLE))
        if unknown:
            raise ValueError(f"scaled: unknown assumption(s) {', '.join(unknown)}; known: {', '.join(self.SCALABLE)}")
        bad = [k for k, f in factors.items() if not (math.isfinite(f) and f > 0)]
        if bad:
            raise ValueError(f"scaled: factors must be finite and > 0: {', '.join(bad)}")
        hw = self.hw
        hw_fields = {k: getattr(hw, k) * factors[k] for k in ("interconnect_bw", "kernel_launch_s", "graph_replay_s")
                     if k in factors and getattr(hw, k) is not None}
        out = HardwareStepCost(
            self.work, replace(hw, **hw_fields), self.layout, self.graphs,
            self.host.scaled(factors.get("host", 1.0)), self.weight_dtype,
            min(1.0, self.mfu * factors.get("mfu", 1.0)), min(1.0, self.mbu * factors.get("mbu", 1.0)),
            comm=self.comm.scaled(factors.get("collective_latency", 1.0)), fused_kernels=self.fused_kernels,
            graph_max_batch=self.graph_max_batch)
        out._scaled = {**self._scaled}
        for k, f in factors.items():
            out._scaled[k] = out._scaled.get(k, 1.0) * f
        return out

    def assumptions(self) -> list[dict]:
        """Every number the model uses, each with its source ({"name", "value", "source"})."""
        hw, lay, src = self.hw, self.layout, self.hw.sources

        def note(key: str, text: str) -> str:
            f = self._scaled.get(key)
            if f is None:
                return text
            return f"{text} (x{f:g} for sensitivity{', capped at 1' if key in ('mfu', 'mbu') else ''})"

        eff = src.get("efficiency", f"{hw.name} profile")
        rows = [
            ("hardware", hw.name, f"analyze/hardware_profiles: {hw.note or hw.name}"),
            ("devices", lay.devices, "given: the replica's GPUs (--hardware NAMExCOUNT)"),
            (f"peak_flops_{self.weight_dtype}", hw.peak(self.weight_dtype), src.get("peak_flops", "")),
            ("peak_flops_bf16", hw.peak("bf16"), src.get("peak_flops", "")),
            ("mem_bw", hw.mem_bw, src.get("mem_bw", "")),
            ("interconnect_bw", hw.interconnect_bw, note("interconnect_bw", src.get("interconnect_bw", "")
                                                           + "; used at its peak, no efficiency factor")),
            ("mfu", self.mfu, note("mfu", eff)),
            ("mbu", self.mbu, note("mbu", eff)),
            ("kernel_launch_s", hw.kernel_launch_s, note("kernel_launch_s", src.get("kernel_launch_s", ""))),
            ("graph_replay_s", hw.graph_replay_s, note("graph_replay_s", src.get("graph_replay_s", ""))),
            ("host_step_s", self.host.step_s, note("host", self.host.step_source)),
            ("host_per_seq_s", self.host.per_seq_s, note("host", self.host.per_seq_source)),
            ("all_reduce_latency_s", self.comm.all_reduce_latency_s,
             note("collective_latency", self.comm.all_reduce_source)),
            ("all_to_all_latency_s", self.comm.all_to_all_latency_s,
             note("collective_latency", self.comm.all_to_all_source)),
            ("weight_dtype", self.weight_dtype, "given; weights and experts run at its peak, attention, KDA "
             "recurrence and the LM head (bf16 in FP8 checkpoints, memory.quantized_components) at bf16's"),
            ("kv_dtype", self.kv_dtype, "the StepWork's cache format (analyze.cache row sizes)"),
            ("tp", lay.tp, "given; FLOPs of weights, attention, recurrence and head / tp; non-expert weight bytes "
             f"/ tp except the replicated {', '.join(REPLICATED)} (memory.py's layout)"),
            ("ep", lay.ep, "given; routed-expert FLOPs and bytes of the distinct experts touched (uniform routing) "
             "/ devices: ep groups of n_experts/ep experts, each sharded devices/ep ways; load imbalance not modelled"),
            ("cache_bytes_per_device", "replicated", "MLA latent and indexer keys are replicated within the tp group "
             "(each rank reads every row it attends for its 1/tp of the heads), KDA state is split by heads (/ tp)"),
            ("all_reduces_per_step", self._all_reduces, "tensor parallelism: one all-reduce after the mixer and one "
             f"after the FFN per layer, tokens x hidden x {ACTIVATION_BYTES} B, ring cost 2 (tp-1)/tp x bytes / "
             "interconnect_bw + latency"),
            ("all_to_alls_per_step", self._all_to_alls, "expert parallelism: a dispatch and a combine per MoE layer "
             f"of tokens / devices x top-k x hidden x ({self.dispatch_bytes} B dispatch + {ACTIVATION_BYTES} B "
             "combine) x (ep-1)/ep / interconnect_bw per device + latency each way: DeepEP style, each rank "
             "dispatches its share of the step's tokens. Stacks that keep tokens replicated and combine in the FFN "
             "all-reduce (vLLM / SGLang EP without DP attention) pay no all-to-all: model them with ep=1, which "
             "here costs the same expert FLOPs and bytes per device"),
            ("communication_overlap", "none", "assumption: collectives are not overlapped with compute"),
            ("kernels_per_step", self.fixed_kernels, KERNELS_SOURCE + "; by kind: " + ", ".join(
                f"{k} {v}" for k, v in self.kernels_by_kind.items() if v)
             + ("" if self.fused_kernels else "; plus StepWork.op_counts (per prefill sequence per layer, "
                "per distinct expert per MoE layer)")),
            *((f"kernels_per_layer_{k}", v, KERNELS_SOURCE) for k, v in KERNELS_PER_LAYER.items()),
            ("kernels_outside_layers", KERNELS_PER_STEP, KERNELS_SOURCE),
            ("kernels_per_draft_call", KERNELS_PER_DRAFT_CALL, KERNELS_SOURCE + "; one MTP drafter call: its input "
             "norms and projection, a DSA layer with its indexer, an MoE layer, its norm, the LM head and argmax"),
            ("graphs", self.graphs, "given; decode-only steps replay a CUDA graph (kernels x graph_replay_s after "
             "the GPU work); steps with a prefill run eagerly, as vLLM / SGLang capture decode batches only; eager "
             "steps wait for kernel launches only beyond the GPU work"),
            ("graph_max_batch", self.graph_max_batch, "estimate of a serving stack's largest captured decode "
             "batch (vLLM's default capture sizes go up to 512); larger decode batches run eagerly"),
        ]
        return [{"name": n, "value": v, "source": s} for n, v, s in rows]
