"""What one simulation runs: a model, the engine arguments its server would run with, and where
its step costs come from: a calibration of this machine (``flashlane calibrate``) or the stated
assumptions of named GPUs (``analyze.gpu_step_cost``).

A stack's mechanisms (``bench.stack_files.Mechanisms``) map to engine arguments here too, so a
stack file for vLLM or SGLang, which gives no `flashlane serve` flags, can still be simulated,
and a counterfactual ("this stack, but with prefix caching for the hybrid") is one change of
mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import acceptance
from ..analyze.cache import cache_bytes
from ..analyze.calibration import MACHINE_KEYS, Calibration, load_calibration
from ..analyze.gpu_step_cost import HardwareStepCost, HostAssumptions, ParallelLayout, parse_hardware_spec
from ..analyze.memory import Layout, device_memory
from ..analyze.models import resolve_model
from ..analyze.params import count_params
from ..analyze.step_cost import HOST_TERMS, StepCostModel, StepWork
from ..bench.stack_files import Mechanisms
from ..config import ModelConfig
from .front_end import FrontEnd
from .prompts import prompt_tokenizer
from .run import SimSetup

if TYPE_CHECKING:
    from .speed_probe import Drift

# A GPU engine's step budget (vLLM's default max_num_batched_tokens for online serving), where the
# engine arguments do not give one.
GPU_BATCHED_TOKENS = 8192
GPU_MAX_NUM_SEQS = 256
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def is_stateful(cfg: ModelConfig) -> bool:
    """Does the model carry recurrent (linear-attention) state a prefix cache must restore?"""
    return "kda" in cfg.mixer_types


def mechanism_args(m: Mechanisms, cfg: ModelConfig) -> dict:
    """The engine arguments that give a stack's mechanisms to this model. A prefix cache that does
    not restore recurrent state gives a hybrid no hits (every turn starts over), which for this
    engine is the prefix cache off."""
    args = {"enable_prefix_caching": m.prefix_cache and (m.prefix_cache_stateful or not is_stateful(cfg)),
            "compile": m.static_graphs}
    if m.batching == "static":
        args.update(scheduler="static", max_wait_ms=0.0)
        if m.static_batch_size:
            args["static_batch_size"] = m.static_batch_size
    else:
        args.update(scheduler="continuous", max_wait_ms=m.batching_window_ms)
    if m.speculative_method is not None:       # (the simulator assumes an acceptance length: with_acceptance)
        args["speculative_config"] = {"method": m.speculative_method,
                                      "num_speculative_tokens": m.num_speculative_tokens}
    return args


@dataclass(frozen=True)
class Source:
    """Where the step costs came from, for the manifest and the report."""
    kind: str            # "calibration" | "hardware"
    detail: dict


def with_acceptance(engine_args: dict) -> tuple[dict, dict | None]:
    """``engine_args`` whose ``speculative_config`` states a mean acceptance length (the simulated
    server accepts drafts at random, as the engine's synthetic acceptance does): the given one, or
    ``acceptance.ASSUMED`` carried to the config's draft count; and the assumption row, if assumed."""
    from ..engine.speculative.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(engine_args.get("speculative_config"))
    if spec is None or spec.synthetic:
        return engine_args, None
    length = round(acceptance.assumed_length(spec.num_speculative_tokens), 4)
    config = {**spec.as_dict(), "rejection_sample_method": "synthetic", "synthetic_acceptance_length": length}
    return ({**engine_args, "speculative_config": config},
            {"name": "acceptance_length", "value": length, "source": acceptance.ASSUMED_SOURCE
             + "; give your own with speculative_config.synthetic_acceptance_length"})


def speculative_mode(value) -> dict | None:
    """The drafter and draft count of a ``speculative_config`` (what a calibration must share)."""
    from ..engine.speculative.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(value)
    return spec.mode() if spec is not None else None


def calibrated(model: str, calibration: str | Calibration, engine_args: dict,
               machine: dict | None = None, zero_host: bool = False,
               drift: Drift | None = None) -> tuple[SimSetup, list[str]]:
    """A simulation of MODEL as `flashlane serve` with ``engine_args`` runs on the calibration's
    machine. The calibration must be of this model and of the mode these arguments run in (dtype,
    kv-cache dtype, quantisation, static graphs, threads): a mismatch is a ValueError naming it.
    ``zero_host``: the counterfactual without host time (the fitted per-step, per-sequence and
    dispatch terms and the front end set to zero: only the op groups' time is left). ``drift``:
    the machine's speed beside a measured run against the calibration's (``speed_probe.drift``),
    applied to the step costs and the front end. Returns the setup and warnings (another machine
    than ``machine``, say)."""
    named = resolve_model(model)
    if isinstance(calibration, Calibration):
        cal = calibration
        warnings = [f"machine {k}: the calibration has {cal.machine.get(k)!r}, this run has {machine[k]!r}"
                    for k in MACHINE_KEYS if machine and k in machine and machine[k] != cal.machine.get(k)]
    else:
        cal, warnings = load_calibration(calibration, machine=machine, strict=False)
    where = cal.model if isinstance(calibration, Calibration) else str(calibration)
    if cal.model != model:
        raise ValueError(f"calibration {where} is of model {cal.model!r}, not {model!r}")
    args, assumed = with_acceptance(dict(engine_args))
    if args.get("dtype") in (None, "auto"):
        args["dtype"] = cal.mode["dtype"]
    if args.get("num_threads") is None:
        args["num_threads"] = cal.mode.get("num_threads")
    mode = {"dtype": args["dtype"], "kv_cache_dtype": args.get("kv_cache_dtype", "auto"),
            "quantization": args.get("quantization"), "compile": bool(args.get("compile")),
            "num_threads": args["num_threads"], "speculative": speculative_mode(args.get("speculative_config"))}
    if mode["kv_cache_dtype"] == "auto":
        mode["kv_cache_dtype"] = cal.mode["kv_cache_dtype"]
    bad = [f"{k}: the calibration has {cal.mode.get(k)!r}, the simulated server {v!r}"
           for k, v in mode.items() if cal.mode.get(k) != v]
    if bad:
        raise ValueError(f"calibration {where} was measured in another engine mode than the simulated server's: "
                         + "; ".join(bad) + " (calibrate again with those engine flags)")
    front = FrontEnd.from_dict(cal.front_end)
    cost = cal.cost_model(named.cfg)
    if drift is not None:
        cost, front = drift.scale_cost(cost), drift.scale_front_end(front)
    if zero_host:
        front = front.zero()
        cost = StepCostModel(cost.work, cost.peak_flops, cost.mem_bw,
                             {**cost.coefficients, **{t: 0.0 for t in HOST_TERMS}})
    setup = SimSetup(model, named.cfg, front.served(cost.seconds), args,
                     prompt_tokenizer(model, named.cfg.vocab_size), front,
                     assumptions={"step_costs": "calibration", "calibration": {
                         "file": str(where), "machine": cal.machine, "mode": cal.mode,
                         "coefficients": cost.coefficients, "zero_host": zero_host,
                         "drift": drift.to_dict() if drift is not None else None,
                         "served_step_scales": {"prefill": front.served_prefill_scale,
                                                "decode": front.served_decode_scale,
                                                "contention_per_seq": {"prefill": front.served_prefill_contention,
                                                                       "decode": front.served_decode_contention},
                                                "contention_measured_to_seqs": front.served_contention_seqs},
                         "fit": {k: cal.fit.get(k) for k in (
                             "median_rel_error", "p90_rel_error", "n_steps")}},
                         **({"speculative_acceptance": assumed} if assumed else {})})
    return setup, [f"calibration {where}: {w}; the simulated figures are for the calibration's machine"
                   for w in warnings]


def gpu_max_num_seqs(cfg: ModelConfig, cache_bytes_free: float, num_draft_tokens: int = 0,
                     graphs: bool = False) -> int:
    """``GPU_MAX_NUM_SEQS``, fewer where a hybrid's state rows would take more than half the
    cache: with speculative decoding (``num_draft_tokens`` > 0) a second row per running request
    for an eager step's rollback and, with graphs, its per-token states of a verify step."""
    from ..cache_spec import cache_spec

    spec = cache_spec(cfg, mtp=num_draft_tokens > 0)
    per_seq = spec.bytes_per_slot("bfloat16")
    if num_draft_tokens:
        per_seq += spec.draft_rollback_bytes_per_sequence("bfloat16")
        if graphs:
            per_seq += spec.verify_state_bytes_per_sequence(num_draft_tokens, "bfloat16")
    if not per_seq:
        return GPU_MAX_NUM_SEQS
    return max(1, min(GPU_MAX_NUM_SEQS, int(cache_bytes_free / 2 // per_seq)))


def on_hardware(model: str, hardware: str, engine_args: dict, tp: int | None = None, ep: int | None = None,
                weight_dtype: str = "fp8", host: HostAssumptions = HostAssumptions(),
                scale: dict | None = None) -> SimSetup:
    """A simulation of MODEL served on named GPUs (``h200x8``): step costs from the hardware
    profile's stated peaks and efficiencies, TP/EP as communication costs, static graphs (CUDA
    graphs) from ``engine_args["compile"]``; the cache holds what device memory leaves after
    the weights. ``scale`` multiplies named assumptions (sensitivity)."""
    named = resolve_model(model)
    cfg = named.cfg
    engine_args, assumed = with_acceptance(engine_args)
    hw, devices = parse_hardware_spec(hardware)
    layout = ParallelLayout(devices, tp or devices, ep or devices)
    kv = "bf16" if engine_args.get("kv_cache_dtype", "auto") in ("auto", "bfloat16") else "int8"
    graphs = bool(engine_args.get("compile"))
    cost = HardwareStepCost(StepWork(cfg, weight_dtype, kv, graphs=graphs), hw, layout, graphs=graphs,
                            host=host, weight_dtype=weight_dtype)
    if scale:
        cost = cost.scaled(**scale)
    mem = device_memory(cfg, count_params(cfg), cache_bytes(cfg), Layout(tp=layout.tp), hw.mem_bytes,
                        weight_dtype, kv)
    if not mem.fits:
        raise ValueError(f"{model} in {weight_dtype} does not fit {hardware}: {mem.weights / 1e9:.0f} GB of weights "
                         f"per device against {mem.usable / 1e9:.0f} GB usable")
    # the cache gets what the weights leave unless the flags give a budget; activations are bf16
    from ..engine.speculative.config import SpeculativeConfig

    speculative = SpeculativeConfig.parse(engine_args.get("speculative_config"))
    drafts = speculative.num_speculative_tokens if speculative is not None else 0
    args = {"max_num_batched_tokens": GPU_BATCHED_TOKENS,
            "max_num_seqs": gpu_max_num_seqs(cfg, mem.free, drafts, graphs),
            "cache_memory": int(mem.free), **engine_args, "dtype": "bfloat16"}
    return SimSetup(model, cfg, cost.seconds, args, prompt_tokenizer(model, cfg.vocab_size),
                    FrontEnd(source="not modelled on GPUs: zero front-end time assumed"),
                    devices=tuple([hw.name] * devices),
                    assumptions={"step_costs": "hardware", "hardware": hardware, "layout": {
                        "devices": devices, "tp": layout.tp, "ep": layout.ep}, "weight_dtype": weight_dtype,
                        "scaled": dict(scale or {}),
                        "assumptions": cost.assumptions() + ([assumed] if assumed else [])})
