"""The time of one engine step from its composition, fitted to a machine and an engine mode.

    t_step = t_host(step) + sum over op groups g of c_g * max(flops_g / peak, bytes_g / bw)
             + n_ops(step) * t_dispatch + [a prefill chunk] * c_prefill_rows * weight_flops_per_row / peak

``c_g`` is 1 / efficiency of group g. The FLOPs and bytes of every group come from the model
config, through the same functions ``analyze`` uses (``flops``, ``cache``, ``memory``), so the
step-cost model and the roofline cannot disagree about the work. Nothing about the machine or the
engine is assumed: ``t_host`` (per step and per scheduled sequence), the dispatch cost of the
structural op counts and the efficiencies are the coefficients of a non-negative least-squares
fit to the engine's own step records (``fit``). The model is linear in them, so the fit is exact
and repeatable; relative errors are minimised, so short decode steps weigh as much as long prefills.

Op groups: ``weights`` (every matmul against non-expert weights: projections, dense FFN, shared
experts, mHC), ``experts`` (routed experts: FLOPs of the chosen ones, bytes of the distinct experts
the step touches under uniform routing), ``attention`` (indexer scoring, sparse MLA over the
selected rows, dense attention; bytes of the cache rows read and written), ``recurrence`` (the
KDA recurrence and short conv; bytes of the state read and written), ``head`` (the LM head for the
rows that get logits); the fitted model prices the attention of prefill chunks and of decode rows
with a coefficient each. A step with a prefill chunk also pays ``c_prefill_rows`` rows of the
weights' matmuls: a matmul of M rows runs at about M / (M + M0) of its large-M rate (MKL's float32
on one Emerald Rapids core at SmolLM2's shapes: 84 GFLOP/s at 16 rows, 155 at 64, 197 at 256, 210
at 1024), so a turn's 100-row chunk costs more per row than the grid's 2048-row ones; the term
makes the cost of the step's rows M + M0 (M0 = ``c_prefill_rows / c_weights``). Decode-only steps
read the weights at memory speed and do not pay it. Structural op counts (dispatches a step issues
beyond a fixed number per step): one per layer per prefill sequence (per-sequence work in the
mixers) and a few per distinct routed expert per MoE layer.

Speculative decoding: a decode sequence with ``d`` drafts computes ``1 + d`` tokens, all of whose
rows get logits. An eager engine runs them as a small chunk after the sequence's cache; static
graphs run them as ``1 + d`` decode rows at consecutive positions (``StepWork(graphs=True)``), as
flashlane's compiled verify steps and the GPU stacks' captured verify graphs do. The MTP
drafter's pass after a step is its own group, ``draft``: the MTP layer over ``draft_rows`` rows in
``draft_calls`` calls (its catch-up over the committed tokens, then one call per chained draft) and
the LM head over the drafted rows, with a fitted cost per call (``t_draft_call``: a call's host
work and dispatches). The MTP layer's own attention is not counted (one layer of the model's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..config import ModelConfig
from .cache import cache_bytes, index_entry_bytes, latent_row_bytes
from .flops import TokenFlops, fixed_per_token, decode_flops, prefill_flops, sum_attended
from .flops import attended_positions, scored_keys
from .memory import component_bytes
from .params import count_params, expert_params, mtp_layer_params

GROUPS = ("weights", "experts", "attention", "recurrence", "head", "draft")
# the fitted model prices a step's attention for prefill chunks and for decode rows apart: on a CPU
# one is compute-bound matmul work and the other a gather over the cache, whose efficiencies differ
# several-fold (one coefficient for both made SmolLM2's decode 30% off)
FITTED_GROUPS = ("weights", "experts", "attention", "attention_decode", "recurrence", "head", "draft")
# coefficient names, in the order of ``features``
TERMS = ("t_step", "t_seq", "t_dispatch_seq_layer", "t_dispatch_expert", "t_draft_call") + tuple(
    f"c_{g}" for g in FITTED_GROUPS) + ("c_prefill_rows",)
# terms a calibration without speculative decoding never measured (its steps have no drafts): 0
DRAFT_TERMS = ("t_draft_call", "c_draft")
# terms added after calibrations were first written: a file without one was fitted without it, so
# it reads as 0 (that fit's own model)
LATER_TERMS = ("c_prefill_rows",)
# the host side of a step: fixed per step, per sequence, per dispatch and per draft call
HOST_TERMS = ("t_step", "t_seq", "t_dispatch_seq_layer", "t_dispatch_expert", "t_draft_call")
OPS_PER_EXPERT = 4          # gate/up matmul, activation, down matmul, weighted scatter


@dataclass(frozen=True)
class StepShape:
    """What one engine step computed: (new tokens, cached tokens) per prefill chunk, the cached
    tokens before the step per decode sequence (which adds one token) and (drafts, cached
    tokens) per decode sequence that verifies drafts (it adds ``1 + drafts`` tokens); then the
    MTP drafter's pass: its layer's calls, rows and the rows the LM head drafted from."""

    prefill: tuple[tuple[int, int], ...] = ()
    decode: tuple[int, ...] = ()
    verify: tuple[tuple[int, int], ...] = ()
    draft_calls: int = 0
    draft_rows: int = 0
    draft_logit_rows: int = 0

    def __post_init__(self):
        if (any(n < 1 or c < 0 for n, c in self.prefill + self.verify) or any(c < 0 for c in self.decode)
                or min(self.draft_calls, self.draft_rows, self.draft_logit_rows) < 0):
            raise ValueError(f"a step shape needs new tokens >= 1 and cached tokens >= 0, got {self}")
        if not self.prefill and not self.decode and not self.verify:
            raise ValueError("a step shape needs at least one sequence")

    @classmethod
    def from_record(cls, rec: Mapping) -> "StepShape":
        """From an engine step record (``/debug/steps``): ``seq_new_tokens`` and
        ``seq_cached_tokens``; a sequence with one new token is a decode."""
        try:
            new, cached = list(rec["seq_new_tokens"]), list(rec["seq_cached_tokens"])
        except KeyError as exc:
            raise ValueError(f"step record {rec.get('step', '?')}: no {exc.args[0]} (the record is from an "
                             "engine older than the step composition)") from None
        drafts = list(rec.get("seq_draft_tokens") or [0] * len(new))
        if len(new) != len(cached) or len(drafts) != len(new) or not new:
            raise ValueError(f"step record {rec.get('step', '?')}: seq_new_tokens, seq_cached_tokens and "
                             f"seq_draft_tokens must be equally long and not empty, got {len(new)}, "
                             f"{len(cached)} and {len(drafts)}")
        return cls(prefill=tuple((n, c) for n, c, d in zip(new, cached, drafts) if n > 1 and not d),
                   decode=tuple(c for n, c, d in zip(new, cached, drafts) if n == 1),
                   verify=tuple((d, c) for c, d in zip(cached, drafts) if d),
                   draft_calls=int(rec.get("draft_calls", 0)), draft_rows=int(rec.get("draft_rows", 0)),
                   draft_logit_rows=int(rec.get("draft_logit_rows", 0)))

    @property
    def kind(self) -> str:
        """"prefill", "decode" (verify steps included) or "mixed" (prefill chunks beside decode rows)."""
        decoding = self.decode or self.verify
        return "mixed" if self.prefill and decoding else "prefill" if self.prefill else "decode"

    @property
    def num_seqs(self) -> int:
        return len(self.prefill) + len(self.decode) + len(self.verify)

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.prefill) + len(self.decode) + sum(1 + d for d, _ in self.verify)


@dataclass(frozen=True)
class GroupWork:
    flops: float
    bytes: float


class StepWork:
    """FLOPs, bytes and structural op counts of steps of one model at one weight/cache dtype."""

    def __init__(self, cfg: ModelConfig, weight_dtype: str = "bf16", kv_dtype: str = "bf16", graphs: bool = False):
        if weight_dtype not in ("fp32", "bf16", "fp8", "int8"):
            raise ValueError(f"weight dtype must be fp32, bf16, fp8 or int8, got {weight_dtype!r}")
        self.cfg = cfg
        self.graphs = graphs        # verified drafts run as decode rows (static graphs), else as a chunk
        params = count_params(cfg)
        comp = component_bytes(cfg, params, "bf16" if weight_dtype == "fp32" else weight_dtype)
        scale = 2.0 if weight_dtype == "fp32" else 1.0
        self._head_bytes = scale * (comp["head"] or comp["embedding"])   # tied: the head reads the embedding
        self._embed_row_bytes = scale * 2 * cfg.hidden_size                # one embedding row per token
        self._fixed_bytes = scale * sum(v for k, v in comp.items()
                                        if k not in ("head", "embedding", "routed_experts", "mtp"))
        n_experts = params.total_by["routed_experts"] / max(expert_params(cfg), 1)
        self._expert_bytes = scale * comp["routed_experts"] / n_experts if n_experts else 0.0
        self._n_moe = cfg.ffn_types.count("moe")
        self._n_dsa = cfg.mixer_types.count("dsa")
        self._n_full = len(cfg.full_indexer_layers)
        self._n_attn = cfg.mixer_types.count("attn")
        self._n_kda = cfg.mixer_types.count("kda")
        self._latent_row = latent_row_bytes(cfg, kv_dtype)
        self._index_entry = index_entry_bytes(cfg, kv_dtype) if self._n_full else 0.0
        cache = cache_bytes(cfg)
        self._write_per_token = (self._n_dsa + self._n_attn) * self._latent_row + (
            self._n_full * self._index_entry / max(cfg.index_kpool, 1))
        self._state_rw = 2 * (cache.state_recurrent + cache.state_conv)
        fixed = fixed_per_token(cfg)
        self._routed_flops = self._n_moe * 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * (
            cfg.num_experts_per_tok if cfg.n_routed_experts else 0)
        self._weight_flops = fixed["projections"] + fixed["mhc"] + fixed["ffn"] - self._routed_flops
        self._head_flops = fixed["head"]
        # the MTP layer (drafting): its active FLOPs per row, its weights but the routed experts
        mtp_total, mtp_active = mtp_layer_params(cfg) if cfg.num_mtp_layers and cfg.arch != "llama" else (0, 0)
        self._mtp_flops = 2 * mtp_active
        self._mtp_fixed_bytes = scale * comp["mtp"] / max(cfg.num_mtp_layers, 1) * (
            (mtp_total - cfg.n_routed_experts * expert_params(cfg)) / mtp_total if mtp_total else 0.0)

    def distinct_experts(self, tokens: int) -> float:
        """Expected distinct routed experts one MoE layer touches for ``tokens`` tokens (uniform routing)."""
        e, k = self.cfg.n_routed_experts, self.cfg.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** tokens) if e else 0.0

    def attention_parts(self, shape: StepShape) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
        """The step's attention work as (chunks: new, cached) and decode rows (cached before the
        row): verified drafts are a chunk of ``1 + d`` tokens, or with ``graphs`` that many rows."""
        if self.graphs:
            rows = tuple(c + j for d, c in shape.verify for j in range(1 + d))
            return shape.prefill, shape.decode + rows
        return shape.prefill + tuple((1 + d, c) for d, c in shape.verify), shape.decode

    def _attention(self, shape: StepShape) -> tuple[float, float, float]:
        """(attention FLOPs, cache bytes read and written, recurrence FLOPs) of the step."""
        chunks, decode = self.attention_parts(shape)
        cfg, flops, rows, idx_keys, rec = self.cfg, 0.0, 0.0, 0.0, 0.0
        for new, cached in chunks:
            f: TokenFlops = prefill_flops(cfg, new, cached)
            flops += f.indexer_scoring + f.sparse_attention
            rec += f.kda_recurrence
            end = cached + new
            rows += self._n_dsa * (sum_attended(cfg, end) - sum_attended(cfg, cached))
            rows += self._n_attn * end    # dense attention reads each key once per chunk (tiled)
            idx_keys += self._n_full * scored_keys(cfg, end)   # one score matmul per chunk reads each key once
        for cached in decode:
            f = decode_flops(cfg, cached + 1)
            flops += f.indexer_scoring + f.sparse_attention
            rec += f.kda_recurrence
            rows += self._n_dsa * attended_positions(cfg, cached + 1) + self._n_attn * (cached + 1)
            idx_keys += self._n_full * scored_keys(cfg, cached + 1)
        read = rows * self._latent_row + idx_keys * self._index_entry
        return flops, read + shape.num_tokens * self._write_per_token, rec

    def draft(self, shape: StepShape) -> GroupWork:
        """The MTP drafter's pass: its layer's rows, its weights read once per call (the routed
        experts a call's rows touch), the LM head over the drafted rows."""
        if not shape.draft_calls:
            return GroupWork(0.0, 0.0)
        per_call = shape.draft_rows / shape.draft_calls
        experts = self.distinct_experts(per_call) * self._expert_bytes if self._n_moe else 0.0
        return GroupWork(shape.draft_rows * self._mtp_flops + shape.draft_logit_rows * self._head_flops,
                         shape.draft_calls * (self._mtp_fixed_bytes + experts + self._head_bytes))

    def groups(self, shape: StepShape) -> dict[str, GroupWork]:
        tokens = shape.num_tokens
        attn_flops, attn_bytes, rec_flops = self._attention(shape)
        # the last row of each prefill chunk, every decode row, every verified row
        logit_rows = len(shape.prefill) + len(shape.decode) + sum(1 + d for d, _ in shape.verify)
        return {
            "weights": GroupWork(tokens * self._weight_flops, self._fixed_bytes + tokens * self._embed_row_bytes),
            "experts": GroupWork(tokens * self._routed_flops,
                                 self._n_moe * self.distinct_experts(tokens) * self._expert_bytes),
            "attention": GroupWork(attn_flops, attn_bytes),
            "recurrence": GroupWork(rec_flops, shape.num_seqs * self._state_rw if self._n_kda else 0.0),
            "head": GroupWork(logit_rows * self._head_flops, self._head_bytes),
            "draft": self.draft(shape),
        }

    def fitted_groups(self, shape: StepShape) -> dict[str, GroupWork]:
        """``groups`` with the attention of the decode rows apart from the prefill chunks'
        (``FITTED_GROUPS``; the two attention parts sum to ``groups``' attention)."""
        out = self.groups(shape)
        decode = GroupWork(0.0, 0.0)
        rows = self.attention_parts(shape)[1]
        if rows:
            flops, nbytes, _ = self._attention(StepShape(decode=rows))
            decode = GroupWork(flops, nbytes)
        whole = out["attention"]
        out["attention"] = GroupWork(whole.flops - decode.flops, whole.bytes - decode.bytes)
        out["attention_decode"] = decode
        return out

    def op_counts(self, shape: StepShape) -> tuple[float, float]:
        """(per-sequence-per-layer dispatches, per-expert dispatches) beyond the fixed ones."""
        return (len(self.attention_parts(shape)[0]) * self.cfg.num_layers,
                self._n_moe * self.distinct_experts(shape.num_tokens) * OPS_PER_EXPERT)

    def features(self, shape: StepShape, peak_flops: float, mem_bw: float) -> list[float]:
        """The regressors of ``TERMS`` for one step (seconds for the group terms)."""
        groups = self.fitted_groups(shape)
        per_seq_layer, per_expert = self.op_counts(shape)
        roof = [max(g.flops / peak_flops, g.bytes / mem_bw) for g in (groups[n] for n in FITTED_GROUPS)]
        prefill_rows = self._weight_flops / peak_flops if shape.prefill else 0.0
        return [1.0, float(shape.num_seqs), per_seq_layer, per_expert, float(shape.draft_calls), *roof, prefill_rows]


@dataclass(frozen=True)
class Fit:
    coefficients: dict[str, float]
    median_rel_error: float
    p90_rel_error: float
    n_steps: int

    def to_dict(self) -> dict:
        return {"coefficients": dict(self.coefficients), "median_rel_error": self.median_rel_error,
                "p90_rel_error": self.p90_rel_error, "n_steps": self.n_steps}


class StepCostModel:
    """``work`` priced on a machine (``peak_flops``, ``mem_bw``) with fitted ``coefficients``."""

    def __init__(self, work: StepWork, peak_flops: float, mem_bw: float, coefficients: Mapping[str, float]):
        missing = [t for t in TERMS if t not in coefficients]
        if missing:
            raise ValueError(f"step-cost coefficients: missing {', '.join(missing)}")
        bad = [t for t in TERMS if not (math.isfinite(coefficients[t]) and coefficients[t] >= 0)]
        if bad:
            raise ValueError(f"step-cost coefficients must be finite and >= 0: {', '.join(bad)}")
        if not (peak_flops > 0 and mem_bw > 0):
            raise ValueError(f"peak_flops and mem_bw must be > 0, got {peak_flops}, {mem_bw}")
        self.work, self.peak_flops, self.mem_bw = work, peak_flops, mem_bw
        self.coefficients = {t: float(coefficients[t]) for t in TERMS}

    def seconds(self, shape: StepShape) -> float:
        x = self.work.features(shape, self.peak_flops, self.mem_bw)
        return sum(self.coefficients[t] * v for t, v in zip(TERMS, x))

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        """Each term's seconds for ``shape`` (they sum to ``seconds``)."""
        x = self.work.features(shape, self.peak_flops, self.mem_bw)
        return {t: self.coefficients[t] * v for t, v in zip(TERMS, x)}


def prefill_m0(coefficients: Mapping[str, float]) -> float | None:
    """M0 of fitted coefficients: a prefill chunk of M rows runs the weights' matmuls at
    M / (M + M0) of the large-M rate. None where the fit gave the weights no cost."""
    c = coefficients
    return c["c_prefill_rows"] / c["c_weights"] if c["c_weights"] > 0 else None


def _rel_errors(pred: Sequence[float], meas: Sequence[float]) -> list[float]:
    return sorted(abs(p - m) / m for p, m in zip(pred, meas))


def _quantile(sorted_xs: Sequence[float], q: float) -> float:
    i = min(len(sorted_xs) - 1, max(0, math.ceil(q * len(sorted_xs)) - 1))
    return sorted_xs[i]


def error_summary(price: Callable[[StepShape], float], shapes: Sequence[StepShape],
                  seconds: Sequence[float]) -> dict:
    """|predicted - measured| / measured over all steps and by step kind, each step priced by
    ``price`` (a model's ``seconds``): count, median, p90 and the summed measured and predicted
    seconds (so errors that cancel in a sum stay visible)."""
    out = {}
    for kind in ("all", "prefill", "decode", "mixed"):
        pairs = [(s, t) for s, t in zip(shapes, seconds) if kind in ("all", s.kind)]
        if pairs:
            pred = [price(s) for s, _ in pairs]
            errs = _rel_errors(pred, [t for _, t in pairs])
            out[kind] = {"steps": len(pairs), "median_rel_error": _quantile(errs, 0.5),
                         "p90_rel_error": _quantile(errs, 0.9), "measured_s": sum(t for _, t in pairs),
                         "predicted_s": sum(pred)}
    return out


def fit(work: StepWork, shapes: Iterable[StepShape], seconds: Iterable[float], peak_flops: float,
        mem_bw: float) -> tuple[StepCostModel, Fit]:
    """Non-negative least squares of relative error over measured steps. A term whose regressor is
    zero in every step (e.g. ``experts`` for a dense model) gets coefficient 0."""
    import numpy as np
    from scipy.optimize import nnls

    shapes, seconds = list(shapes), [float(s) for s in seconds]
    if len(shapes) != len(seconds):
        raise ValueError(f"fit: {len(shapes)} step shapes but {len(seconds)} durations")
    if len(shapes) < len(TERMS):
        raise ValueError(f"fit: need at least {len(TERMS)} steps, got {len(shapes)}")
    if any(not (s > 0 and math.isfinite(s)) for s in seconds):
        raise ValueError("fit: every step duration must be a positive number")
    x = np.array([work.features(s, peak_flops, mem_bw) for s in shapes])
    y = np.array(seconds)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0                 # an all-zero column stays zero and fits to 0
    a = x / scale / y[:, None]              # rows divided by the measurement: relative error
    coef, _ = nnls(a, np.ones(len(y)), maxiter=50 * len(TERMS))
    coef = coef / scale
    model = StepCostModel(work, peak_flops, mem_bw, dict(zip(TERMS, coef.tolist())))
    errs = _rel_errors([model.seconds(s) for s in shapes], seconds)
    return model, Fit(model.coefficients, _quantile(errs, 0.5), _quantile(errs, 0.9), len(shapes))
