"""How the float linears' weights are stored and multiplied, chosen once at start-up per CPU.

Two formats:

- ``aten``: the weight as loaded, ``torch.nn.functional.linear`` (on x86 CPUs torch calls MKL's
  sgemm, which on AMD CPUs takes a generic code path);
- ``onednn``: the weight reordered once into oneDNN's blocked layout (the format Inductor's CPU
  freezing and vLLM's CPU linears use) and multiplied by oneDNN, whose kernels are chosen by the
  CPU's instruction set rather than its vendor.

One format holds for every row count (a second copy of every weight would double the model's
memory), so ``auto`` times both on this CPU and takes ``onednn`` only where it is no slower at
decode (1 row, on a weight larger than the last-level cache, the bandwidth-bound case) and at
least 10% faster at batch and prefill row counts; ties keep the loaded weights. The choice and
its timings go into the start-up report (``LinearPlan.describe``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cpu_caps import best_time, timed_once

FORMATS = ("aten", "onednn")
CHOICES = ("auto", *FORMATS)
# rows timed per class: decode on a weight past the last-level cache (64 MiB in fp32), batch and
# prefill on a small model's MLP matrix
DECODE_SHAPE = (8192, 2048)
BATCH_SHAPE = (2048, 1024)
ROWS = (("decode", 1, DECODE_SHAPE), ("batch", 16, BATCH_SHAPE), ("prefill", 128, BATCH_SHAPE))
DECODE_TOLERANCE = 1.05        # onednn / aten at decode: no slower (5% timing noise allowed)
BATCH_GAIN = 0.9               # geometric mean onednn / aten over batch + prefill: 10% faster

Timer = Callable[[str, int, tuple[int, int], torch.dtype], float]     # (format, rows, shape, dtype) -> s


def unavailable(fmt: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
    """Why weights of ``dtype`` on ``device`` cannot be held in ``fmt`` (None: they can)."""
    if fmt not in FORMATS:
        raise ValueError(f"linear_kernel must be one of {', '.join(CHOICES)}, got {fmt!r}")
    if fmt == "aten":
        return None
    if torch.device(device).type != "cpu":
        return f"device {torch.device(device)}: oneDNN packed weights are a CPU format"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN packed linears take float32 or bfloat16 weights, not {dtype}"
    try:                                   # bf16 needs AVX512BW/VL/DQ or AVX-NE-CONVERT: ask oneDNN
        pack_weight("onednn", torch.zeros(8, 8, dtype=dtype))
    except RuntimeError as exc:
        return f"oneDNN cannot pack {dtype} weights on this CPU ({str(exc).splitlines()[0]})"
    return None


def pack_weight(fmt: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in ``fmt``'s storage (``aten``: itself)."""
    if fmt == "aten":
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def unpack_weight(fmt: str, packed: torch.Tensor) -> torch.Tensor:
    """The dense [out, in] weight back from ``fmt``'s storage."""
    return packed if fmt == "aten" else packed.to_dense()


def linear(fmt: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + bias with W stored in ``fmt``."""
    if fmt == "aten":
        return torch.nn.functional.linear(x, packed, bias)
    lead = x.shape[:-1]
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.reshape(*lead, out.shape[-1])


@dataclass(frozen=True)
class LinearPlan:
    format: str
    why: str                                 # the start-up report's explanation

    def describe(self) -> str:
        return f"linears {self.format} [{self.why}]"


def measure(fmt: str, rows: int, shape: tuple[int, int], dtype: torch.dtype) -> float:
    """Seconds of one ``fmt`` linear of ``rows`` x ``shape`` (out, in) on random ``dtype`` data."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g).to(dtype)
    x = torch.randn(rows, shape[1], generator=g).to(dtype)
    packed = pack_weight(fmt, w)
    with torch.inference_mode():
        return best_time(lambda: linear(fmt, x, packed, None))


def _cached(fmt: str, rows: int, shape: tuple[int, int], dtype: torch.dtype) -> float:
    return timed_once(("linear", fmt, rows, shape, dtype), lambda: measure(fmt, rows, shape, dtype))


def choose_linear_plan(choice: str, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                       timer: Timer | None = None) -> LinearPlan:
    """The weight format for float linears of ``dtype`` on ``device``: ``choice`` by name (a
    ValueError naming ``linear_kernel`` if it cannot run here) or, for ``auto``, by timing."""
    if choice not in CHOICES:
        raise ValueError(f"linear_kernel must be one of {', '.join(CHOICES)}, got {choice!r}")
    pinned = os.environ.get("FLASHLANE_LINEAR_KERNEL")
    if choice == "auto" and pinned:
        if pinned not in FORMATS:
            raise ValueError(f"FLASHLANE_LINEAR_KERNEL={pinned!r}: choose one of {', '.join(FORMATS)}")
        choice = pinned
    if choice != "auto":
        why_not = unavailable(choice, dtype, device)
        if why_not:
            raise ValueError(f"linear_kernel {choice!r} cannot run here: {why_not}")
        return LinearPlan(choice, "chosen by name" if not pinned else "pinned by FLASHLANE_LINEAR_KERNEL")
    why_not = unavailable("onednn", dtype, device)
    if why_not:
        return LinearPlan("aten", f"onednn: {why_not}")
    timer = timer or _cached
    ratios, notes = {}, []
    for cls, rows, shape in ROWS:
        t = {f: timer(f, rows, shape, dtype) for f in FORMATS}
        ratios[cls] = t["onednn"] / t["aten"]
        notes.append(f"{cls} ({rows} rows, {shape[0]}x{shape[1]}): aten {t['aten'] * 1e3:.2f}ms "
                     f"onednn {t['onednn'] * 1e3:.2f}ms")
    batch = math.sqrt(ratios["batch"] * ratios["prefill"])
    wins = ratios["decode"] <= DECODE_TOLERANCE and batch <= BATCH_GAIN
    rule = (f"onednn/aten decode {ratios['decode']:.2f} (<= {DECODE_TOLERANCE}), batch+prefill {batch:.2f} "
            f"(<= {BATCH_GAIN}) at {torch.get_num_threads()} threads")
    return LinearPlan("onednn" if wins else "aten", f"timed: {rule}; " + "; ".join(notes))


__all__ = ["CHOICES", "FORMATS", "LinearPlan", "choose_linear_plan", "linear", "pack_weight", "unavailable",
           "unpack_weight"]
