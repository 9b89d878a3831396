"""Roofline projection: decode step time, prefill time, TTFT and per-task latency and cost.

Per device, a step takes max(compute time, memory time): FLOPs / (peak x mfu) against bytes /
(bandwidth x mbu). Work is split as the layout in ``memory`` says: attention-side work of a
sequence runs on its tp group, FFN / expert work on all devices. Bytes per decode step = weights
touched (routed experts: the expected number of distinct experts hit by the batch under uniform
routing) + cache rows read (selected latent rows, visible indexer keys) and written + KDA state
read and written. Not modelled: communication, kernel launch gaps, scheduling, queueing; a
task's prefills are not batched with each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from ..config import ModelConfig
from .cache import CacheBytes, cache_bytes, index_entry_bytes, latent_row_bytes
from .flops import TokenFlops, attended_positions, decode_flops, prefill_flops, scored_keys
from .hardware import Hardware
from .memory import DeviceMemory, Layout, component_bytes, device_memory
from .params import ParamCounts, count_params, expert_params, mtp_layer_params
from .task import TaskProfile


@dataclass(frozen=True)
class Setup:
    hardware: Hardware
    layout: Layout = Layout()
    weight_dtype: str = "fp8"
    kv_dtype: str = "bf16"
    mfu: float = 0.6      # fraction of peak FLOP/s reached by large matmuls
    mbu: float = 0.8      # fraction of peak bandwidth reached by streaming reads

    def __post_init__(self):
        for name in ("mfu", "mbu"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"--{name} must be in (0, 1], got {getattr(self, name)}")


@dataclass(frozen=True)
class StepTime:
    flops: float          # per device
    bytes: float          # per device
    compute_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


class Roofline:
    def __init__(self, cfg: ModelConfig, setup: Setup, params: ParamCounts | None = None,
                 cache: CacheBytes | None = None):
        self.cfg, self.setup = cfg, setup
        self.params = params or count_params(cfg)
        self.cache = cache or cache_bytes(cfg)
        lay = setup.layout
        comp = component_bytes(cfg, self.params, setup.weight_dtype)
        head = comp["head"] or comp["embedding"]   # a tied head reads the embedding matrix
        self._attn_weights = (sum((comp[k] for k in ("kda", "mla", "attn", "indexer")), head) / lay.tp
                              + sum(comp[k] for k in ("norms", "mhc", "router")))
        self._ffn_fixed = (comp["dense_ffn"] + comp["shared_experts"]) / lay.tp
        n_experts = self.params.total_by["routed_experts"] / max(expert_params(cfg), 1)
        self._expert_bytes = comp["routed_experts"] / n_experts if n_experts else 0.0
        self._n_moe = cfg.ffn_types.count("moe")
        self._n_dsa = cfg.mixer_types.count("dsa")
        self._n_full = len(cfg.full_indexer_layers)
        self._n_attn = cfg.mixer_types.count("attn")
        self._latent_row = latent_row_bytes(cfg, setup.kv_dtype)
        self._index_entry = index_entry_bytes(cfg, setup.kv_dtype) if self._n_full else 0
        self._state_rw = 2 * (self.cache.state_recurrent + self.cache.state_conv) / lay.tp
        self._head_bytes = head
        self._mtp_bytes = comp["mtp"] / max(cfg.num_mtp_layers, 1)   # one MTP layer

    # ---- pieces ----------------------------------------------------------------------------
    def memory(self) -> DeviceMemory:
        return device_memory(self.cfg, self.params, self.cache, self.setup.layout,
                             self.setup.hardware.mem_bytes, self.setup.weight_dtype, self.setup.kv_dtype)

    def distinct_experts(self, tokens: int) -> float:
        """Expected distinct routed experts one MoE layer touches for ``tokens`` tokens."""
        e, k = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        if not e:
            return 0.0
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def _weights_touched(self, tokens: int) -> float:
        routed = self._n_moe * self.distinct_experts(tokens) * self._expert_bytes / self.setup.layout.devices
        embed_rows = tokens * self.cfg.hidden_size * 2 / self.setup.layout.tp
        return self._attn_weights + self._ffn_fixed + routed + embed_rows

    def _compute_s(self, f: TokenFlops, seqs_per_group: float, tokens_total: float) -> tuple[float, float]:
        s, hw, lay = self.setup, self.setup.hardware, self.setup.layout
        peak_w = hw.peak(s.weight_dtype) * s.mfu
        peak_a = hw.peak("bf16") * s.mfu
        attn_side = seqs_per_group * ((f.projections + f.mhc + f.head) / peak_w + f.attention / peak_a) / lay.tp
        ffn_side = tokens_total * f.ffn / lay.devices / peak_w
        flops = (seqs_per_group * (f.projections + f.mhc + f.head + f.attention) / lay.tp
                 + tokens_total * f.ffn / lay.devices)
        return flops, attn_side + ffn_side

    def _kv_read(self, context: int, queries: int = 1) -> float:
        """Cache bytes one sequence's ``queries`` rows at ``context`` read: each DSA query its own
        selected latent rows; the indexer keys and a dense layer's keys once (one scoring matmul,
        a tiled attention over the rows), as ``step_cost`` prices a chunk."""
        cfg = self.cfg
        rows = queries * self._n_dsa * attended_positions(cfg, context) + self._n_attn * context
        return rows * self._latent_row + self._n_full * scored_keys(cfg, context) * self._index_entry

    # ---- public projections ----------------------------------------------------------------
    def decode_step(self, batch: int, context: int) -> StepTime:
        """One decode step for ``batch`` sequences, each at ``context`` visible tokens."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        per_group = ceil(batch / self.setup.layout.dp)
        f = decode_flops(self.cfg, context)
        flops, compute_s = self._compute_s(f, per_group, batch)
        per_seq = self._kv_read(context) + self.cache.per_token(self.setup.kv_dtype) + self._state_rw
        nbytes = self._weights_touched(batch) + per_group * per_seq
        return StepTime(flops, nbytes, compute_s, nbytes / (self.setup.hardware.mem_bw * self.setup.mbu))

    def prefill(self, new_tokens: int, cached: int = 0) -> StepTime:
        """Prefill of one sequence's ``new_tokens`` after ``cached`` cached ones (= its TTFT)."""
        f = prefill_flops(self.cfg, new_tokens, cached)
        flops, compute_s = self._compute_s(f, 1, 1)
        nbytes = (self._weights_touched(new_tokens) + (cached + new_tokens) * self.cache.per_token(self.setup.kv_dtype)
                  + self._state_rw)
        return StepTime(flops, nbytes, compute_s, nbytes / (self.setup.hardware.mem_bw * self.setup.mbu))

    def verify_step(self, batch: int, context: int, drafts: int) -> StepTime:
        """A speculative verify step: ``batch`` sequences, each computing its last token and
        ``drafts`` drafts at about ``context`` visible tokens (each row attends its own selection;
        the rows route to the distinct experts of ``batch x (1 + drafts)`` tokens)."""
        if batch < 1 or drafts < 0:
            raise ValueError(f"batch must be >= 1 and drafts >= 0, got {batch}, {drafts}")
        rows = 1 + drafts
        per_group = ceil(batch / self.setup.layout.dp)
        f = decode_flops(self.cfg, context)
        flops, compute_s = self._compute_s(f, per_group * rows, batch * rows)
        per_seq = (self._kv_read(context, rows) + rows * self.cache.per_token(self.setup.kv_dtype)
                   + self._state_rw)
        nbytes = self._weights_touched(batch * rows) + per_group * per_seq
        return StepTime(flops, nbytes, compute_s, nbytes / (self.setup.hardware.mem_bw * self.setup.mbu))

    def mtp_pass(self, batch: int, drafts: int) -> StepTime:
        """The MTP drafter after a verify step: ``drafts`` calls of its layer (the catch-up, then the
        chained drafts), each over ``batch`` rows plus the LM head, its weights and the routed
        experts its rows touch read once per call; its attention is not counted (one layer's)."""
        s, lay, cfg = self.setup, self.setup.layout, self.cfg
        if not cfg.num_mtp_layers or cfg.arch == "llama":
            raise ValueError(f"{cfg.arch} has no MTP layer")
        total, active = mtp_layer_params(cfg)
        routed = cfg.n_routed_experts * expert_params(cfg)
        per_param = self._mtp_bytes / max(total, 1)
        head_flops = decode_flops(cfg, 1).head
        per_call_bytes = ((total - routed) * per_param + self._head_bytes) / lay.tp + (
            self.distinct_experts(batch) * expert_params(cfg) * per_param / lay.devices)
        flops = drafts * batch * (2 * active + head_flops) / lay.tp
        compute_s = flops / (s.hardware.peak(s.weight_dtype) * s.mfu)
        nbytes = drafts * per_call_bytes
        return StepTime(flops, nbytes, compute_s, nbytes / (s.hardware.mem_bw * s.mbu))

    def speculative_decode(self, batch: int, context: int, drafts: int, length: float) -> dict:
        """Decode with MTP drafting at mean acceptance ``length``: a verify step and the MTP pass per
        ``length`` tokens of each sequence, against plain decode steps."""
        plain = self.decode_step(batch, context).seconds
        step = self.verify_step(batch, context, drafts).seconds + self.mtp_pass(batch, drafts).seconds
        return {"drafts": drafts, "acceptance_length": length, "step_s": step, "tokens_per_s_per_seq": length / step,
                "speedup": length / step * plain}

    def decode_seconds(self, batch: int, start: int, tokens: int) -> float:
        """Time to decode ``tokens`` tokens after ``start`` visible tokens (trapezoid over contexts)."""
        if tokens <= 0:
            return 0.0
        if tokens <= 64:
            return sum(self.decode_step(batch, start + j).seconds for j in range(1, tokens + 1))
        pts = 16
        xs = [start + 1 + round(i * (tokens - 1) / pts) for i in range(pts + 1)]
        ys = [self.decode_step(batch, x).seconds for x in xs]
        area = sum((xs[i + 1] - xs[i]) * (ys[i] + ys[i + 1]) / 2 for i in range(pts))
        return area + (ys[0] + ys[-1]) / 2   # trapezoid covers tokens - 1 gaps; add one step

    def task(self, profile: TaskProfile, concurrency: int = 1) -> dict:
        """Model time of one task when ``concurrency`` tasks share the replica (decode batched,
        prefills of all lanes serialised), its cost, and the replica's tasks per hour."""
        prefill_s = sum(self.prefill(t.new_tokens, t.cached).seconds for t in profile.turns)
        ttfts = [self.prefill(t.new_tokens, t.cached).seconds for t in profile.turns]
        decode_s = sum(self.decode_seconds(concurrency, t.cached + t.new_tokens, t.output) for t in profile.turns)
        latency = concurrency * prefill_s + decode_s
        gpu_hours = latency * self.setup.layout.devices / 3600 / concurrency
        price = self.setup.hardware.usd_per_hour
        return {
            "concurrency": concurrency,
            "latency_s": latency,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "mean_ttft_s": sum(ttfts) / len(ttfts),
            "max_ttft_s": max(ttfts),
            "tasks_per_hour": 3600 * concurrency / latency,
            "gpu_hours_per_task": gpu_hours,
            "usd_per_task": None if price is None else gpu_hours * price,
        }
