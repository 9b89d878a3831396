"""Assemble the analysis of one or two models into one JSON-able dict (stable keys)."""

from __future__ import annotations

from dataclasses import dataclass

from ..acceptance import ASSUMED_SOURCE, assumed_length
from . import claims as C
from .cache import cache_bytes
from .flops import decode_flops, prefill_flops
from .memory import MEM_FRACTION, quantized_components
from .models import NamedConfig
from .params import COMPONENTS, count_params
from .roofline import Roofline, Setup
from .task import TaskProfile


@dataclass(frozen=True)
class Options:
    contexts: tuple[int, ...] = (8 * 1024, 128 * 1024, 1024 ** 2)
    batch: int = 32


SPECULATIVE_DRAFTS = 3      # the GLM recipes' MTP draft count (SGLang, InferenceX)


def _ctx(t: int) -> str:
    return str(t)


def analyze_model(model: NamedConfig, setup: Setup, task: TaskProfile, opts: Options) -> dict:
    cfg = model.cfg
    params, cache = count_params(cfg), cache_bytes(cfg)
    roof = Roofline(cfg, setup, params, cache)
    mem = roof.memory()
    flops = {_ctx(t): decode_flops(cfg, t) for t in opts.contexts}
    decode, prefill, max_seqs, speculative = {}, {}, {}, {}
    drafting = bool(cfg.num_mtp_layers) and cfg.arch != "llama"
    for t in opts.contexts:
        fit = mem.max_sequences(t) if mem.fits else 0
        max_seqs[_ctx(t)] = fit
        one = roof.decode_step(1, t)
        b = min(opts.batch, fit)
        many = roof.decode_step(b, t) if b else None
        decode[_ctx(t)] = {
            "batch1": {"step_s": one.seconds, "tokens_per_s": 1 / one.seconds, "bound": one.bound, "fits": fit >= 1},
            "batch": {"size": b, "requested": opts.batch, "fits": fit >= opts.batch,
                      "step_s": many.seconds if many else None,
                      "tokens_per_s": b / many.seconds if many else None,
                      "tokens_per_s_per_seq": 1 / many.seconds if many else None,
                      "bound": many.bound if many else None},
        }
        p = roof.prefill(t)
        prefill[_ctx(t)] = {"seconds": p.seconds, "bound": p.bound}
        if drafting:
            k, length = SPECULATIVE_DRAFTS, assumed_length(SPECULATIVE_DRAFTS)
            speculative[_ctx(t)] = {"batch1": roof.speculative_decode(1, t, k, length),
                                    "batch": roof.speculative_decode(b, t, k, length) if b else None}
    task_b = max(min(opts.batch, mem.max_sequences(task.max_context) if mem.fits else 0), 1)
    return {
        "name": model.name,
        "source": model.source,
        "arch": cfg.arch,
        "layers": {
            "total": cfg.num_layers, "kda": cfg.mixer_types.count("kda"), "dsa": cfg.mixer_types.count("dsa"),
            "attn": cfg.mixer_types.count("attn"), "full_indexer": len(cfg.full_indexer_layers),
            "moe": cfg.ffn_types.count("moe"), "dense": cfg.ffn_types.count("dense"),
            "mtp": cfg.num_mtp_layers if cfg.arch != "llama" else 0,
        },
        "params": {
            "total": params.total, "active": params.active, "total_without_mtp": params.total_without_mtp,
            "active_with_mtp": params.active_with_mtp, "active_without_embedding": params.active_without_embedding,
            "by_component": {k: {"total": params.total_by[k], "active": params.active_by[k]}
                             for k in COMPONENTS if params.total_by[k]},
        },
        "cache": {
            "bytes_per_token": cache.bytes_per_token,
            "latent_bytes_per_token": dict(cache.latent_per_token),
            "index_bytes_per_token": dict(cache.index_per_token),
            "mtp_bytes_per_token": dict(cache.mtp_per_token),
            "pool_bytes_per_token": {f: dict(v) for f, v in cache.pool_per_token.items()},
        },
        "state": {
            "bytes_per_sequence": cache.state_per_sequence,
            "kda_recurrent": cache.state_recurrent, "kda_conv": cache.state_conv,
            "index_tail": cache.state_index_tail,
            "speculative_rollback_bytes_per_sequence": cache.draft_rollback,
            "speculative_verify_state_bytes_per_sequence_per_draft": cache.verify_state_per_draft,
        },
        "flops": {
            "attention_per_token": {k: f.attention for k, f in flops.items()},
            "total_per_token": {k: f.total for k, f in flops.items()},
            "by_component": {k: f.as_dict() for k, f in flops.items()},
            "prefill": {_ctx(t): prefill_flops(cfg, t).total for t in opts.contexts},
        },
        "memory": {
            "weight_dtype": setup.weight_dtype, "kv_dtype": setup.kv_dtype,
            "weights_per_device": mem.weights, "usable_per_device": mem.usable, "fits": mem.fits,
            "kv_tokens_per_replica": mem.max_tokens if mem.fits else 0,
            "max_sequences": max_seqs,
        },
        "roofline": {
            "decode": decode,
            "prefill": prefill,
            # MTP speculative decoding at the assumed acceptance (acceptance.ASSUMED): a verify step
            # and the MTP pass per accepted length, against plain decode steps
            "speculative_mtp": speculative or None,
            "task": {"c1": roof.task(task, 1), "cB": roof.task(task, task_b),
                     "fits": mem.fits and mem.max_sequences(task.max_context) >= 1},
        },
    }


def _div(b, a):
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _div(b[k], a[k]) for k in a if k in b}
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and a:
        return b / a
    return None


def ratios(a: dict, b: dict) -> dict:
    """baseline / model for the headline numbers (same nesting as the model entries)."""
    return {
        "params": _div({"total": b["params"]["total"], "active": b["params"]["active"]},
                       {"total": a["params"]["total"], "active": a["params"]["active"]}),
        "cache": {"bytes_per_token": _div(b["cache"]["bytes_per_token"], a["cache"]["bytes_per_token"])},
        "state": {"bytes_per_sequence": _div(b["state"]["bytes_per_sequence"], a["state"]["bytes_per_sequence"])},
        "flops": {k: _div(b["flops"][k], a["flops"][k]) for k in ("attention_per_token", "total_per_token", "prefill")},
        "roofline": {
            "decode_tokens_per_s_batch1": {k: _div(b["roofline"]["decode"][k]["batch1"]["tokens_per_s"],
                                                   a["roofline"]["decode"][k]["batch1"]["tokens_per_s"])
                                           for k in a["roofline"]["decode"]},
            "task_latency_c1": _div(b["roofline"]["task"]["c1"]["latency_s"], a["roofline"]["task"]["c1"]["latency_s"]),
            "usd_per_task_c1": _div(b["roofline"]["task"]["c1"]["usd_per_task"],
                                    a["roofline"]["task"]["c1"]["usd_per_task"]),
        },
    }


def assumptions(models: list[NamedConfig], setup: Setup, task: TaskProfile, opts: Options) -> list[str]:
    hw, lay = setup.hardware, setup.layout
    out = [
        "Parameters: tensors of the transformers in-memory state dict (persistent buffers such as the router "
        "correction bias included) plus the MTP layer(s); active = non-expert tensors incl. embedding and LM head "
        "+ shared experts + top-k routed experts, MTP excluded.",
        "Cache bytes/token: bf16 = what the engine's pools allocate (latent rows of MLA/attention layers + pooled "
        "indexer keys of full-indexer layers only); fp8 = serving-stack format (e4m3 + fp32 scale per 128 values, "
        "MLA RoPE part in bf16, 656 B/layer for GLM-5.x, 132 B per indexer entry); int8 = 1 B/value + fp32 scale "
        "per 128 values. MTP rows are listed separately and only counted in memory planning.",
        "State/sequence: KDA recurrent state fp32 + KDA conv state and indexer tail ring in bf16; independent of "
        "context.",
        "FLOPs: 2 per multiply-add; weight matmuls 2x weights per token; norms/activations/softmax/top-k not "
        "counted; MLA absorbed form (score 2(kv_lora+rope), value 2 kv_lora per head and position); attended "
        "positions = min(T, topk) (+ tail of the incomplete pool when kpool > 1); indexer scores every visible "
        "complete pool (kpool tokens) or token; KDA decode 7 D^2/head/token, prefill chunked 6 D^2 + 7*64*D; "
        "MTP not counted, except in the speculative decoding rows.",
        f"Speculative decoding (MTP models): {SPECULATIVE_DRAFTS} drafts per step at a mean acceptance length of "
        f"{assumed_length(SPECULATIVE_DRAFTS):.3g} ({ASSUMED_SOURCE}); a verify step computes 1 + drafts rows per "
        "sequence (weights read once, the routed experts of all rows, each row's cache reads), then the MTP layer "
        "runs once per draft over the batch (its weights, the routed experts its rows touch and the LM head read "
        "each time; its attention not counted); speedup = accepted tokens per (verify + MTP) time over plain decode "
        "tokens per step time.",
        f"Hardware {hw.name}: {hw.peak('bf16') / 1e12:.4g} TFLOP/s bf16, {hw.peak('fp8') / 1e12:.4g} TFLOP/s fp8, "
        f"{hw.mem_bw / 1e12:.4g} TB/s, {hw.mem_bytes / 1e9:.4g} GB, {_price(hw.usd_per_hour)} ({hw.note}).",
        f"Efficiency: {setup.mfu:.0%} of peak FLOP/s, {setup.mbu:.0%} of peak bandwidth; step time = max(compute, "
        "memory); no communication, launch gaps, scheduling or queueing.",
        f"Layout: TP {lay.tp} x DP {lay.dp} = {lay.devices} device(s); attention-side weights split over TP, routed "
        f"experts over all devices (EP {lay.devices}); MLA latent and indexer keys replicated within a TP group, "
        f"KDA state split by heads; {MEM_FRACTION:.0%} of device memory for weights + cache.",
        f"Weights {setup.weight_dtype}" + _weight_note(models, setup.weight_dtype) + f". KV cache {setup.kv_dtype}.",
        "Decode at batch B: all B sequences at the same context; routed-expert bytes = expected distinct experts "
        "under uniform routing, E(1-(1-k/E)^B). Batch is capped by what fits in memory.",
        f"Task profile: {task.description}; {len(task.turns)} requests, {task.prefilled_tokens} prefilled + "
        f"{task.output_tokens} generated tokens, context up to {task.max_context}. Task time = model time only "
        "(no tool/think time); at concurrency c decode is batched and the c lanes' prefills serialise; "
        "$ per task = task time x devices x $/GPU-hour / c.",
        "Ratios are baseline / model: for sizes, FLOPs, times and $ a ratio > 1 means the model needs less; "
        "for rates and capacities (tok/s, tasks/hour, tokens, sequences) a ratio < 1 means the model does more.",
    ]
    return out


def _price(usd_per_hour: float | None) -> str:
    return "no price (no $ per task)" if usd_per_hour is None else f"${usd_per_hour:.2f}/GPU-hour"


def _quantized(model: NamedConfig) -> list[str]:
    counts = count_params(model.cfg).total_by
    names = [c for c in quantized_components(model.cfg) if counts.get(c)]
    if model.cfg.arch == "glm5_next":
        names = [n + " (not kv_b_proj)" if n in ("mla", "mtp") else n for n in names]
    return names


def _weight_note(models: list[NamedConfig], dtype: str) -> str:
    if dtype == "bf16":
        return ""
    per_model = "; ".join(f"{m.name}: {', '.join(_quantized(m))}" for m in models)
    return f" (+128x128 block scales) for {per_model}; bf16 elsewhere"


def build_report(models: list[NamedConfig], setup: Setup, task: TaskProfile, opts: Options) -> dict:
    entries = [analyze_model(m, setup, task, opts) for m in models]
    report = {
        "models": entries,
        "ratios": ratios(entries[0], entries[1]) if len(entries) == 2 else {},
        "contexts": list(opts.contexts),
        "hardware": {"name": setup.hardware.name, "usd_per_hour": setup.hardware.usd_per_hour},
        "setup": {"tp": setup.layout.tp, "dp": setup.layout.dp, "devices": setup.layout.devices,
                  "weight_dtype": setup.weight_dtype, "kv_dtype": setup.kv_dtype, "mfu": setup.mfu,
                  "mbu": setup.mbu, "batch": opts.batch},
        "task": {"name": task.name, "description": task.description, "requests": len(task.turns),
                 "prefilled_tokens": task.prefilled_tokens, "output_tokens": task.output_tokens,
                 "max_context": task.max_context},
        "assumptions": assumptions(models, setup, task, opts),
        "claims": [c.as_dict() for c in evaluate_claims(models, entries, setup, opts)],
    }
    return report


def evaluate_claims(models: list[NamedConfig], entries: list[dict], setup: Setup, opts: Options) -> list:
    sides = [C.Side(m.name, m.cfg, count_params(m.cfg), cache_bytes(m.cfg)) for m in models]
    contexts = list(opts.contexts)
    out = []
    a = sides[0]
    b = sides[1] if len(sides) == 2 else None
    if b is not None:
        out.append(C.attention_claim(a, b, contexts))
        out.append(C.kv_claim(a, b, contexts))
    pool = C.indexpool_claim(a, b, contexts)
    if pool is not None:
        out.append(pool)
    for s in sides:
        size = C.size_claim(s)
        if size is not None:
            out.append(size)
    if b is not None:
        out.append(C.cost_claim(a, b, entries[0]["roofline"]["task"]["c1"], entries[1]["roofline"]["task"]["c1"],
                                setup.hardware.name))
    return out
