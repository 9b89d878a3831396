"""How the float linears' weights are stored and multiplied, chosen once at start-up per CPU.

Three formats:

- ``aten``: the weight as loaded, ``torch.nn.functional.linear`` (on x86 CPUs torch calls MKL's
  sgemm, which on AMD CPUs takes a generic code path);
- ``onednn``: the weight reordered once into oneDNN's blocked layout (the format Inductor's CPU
  freezing and vLLM's CPU linears use) and multiplied by oneDNN, whose kernels are chosen by the
  CPU's instruction set rather than its vendor;
- ``native``: the weight as loaded; up to ``row_gemm.MAX_ROWS`` rows (decode) go through
  flashlane's own kernels (``native/row_gemm.cpp``: float32, AVX2, or its AVX-512 build with the
  same sums; ``native/row_gemm_bf16.cpp``:
  bfloat16 where the CPU has AVX512_BF16; single-threaded, batch-invariant), more rows (prefill)
  through torch as in ``aten``.

One storage holds for every row count (a second copy of every weight would double the model's
memory), so ``auto`` times the formats on this CPU. ``onednn`` is taken only where it is no slower
at decode (1 row, on a weight larger than the last-level cache, the bandwidth-bound case), at
least 10% faster at batch and small-prefill row counts, and no slower at a prefill chunk's row
count (1024: on a Zen 3 at 2 threads it was 0.70-0.84x aten's time at 16-128 rows but 1.22x at
1024 and 1.36x at 2048, which made SmolLM2's prefill 20% slower); ``native`` only where it is no
slower at 1 row nor at a few rows and at least 10% faster where it is meant to win (float32: 8
rows; bfloat16: 1 row; its prefill is aten's); where both qualify, the faster at decode. Ties
keep the loaded weights. Each format is timed beside aten, the two called in turn on the same
weight (``measure_beside_aten``). The choice and its timings go into the start-up report
(``LinearPlan.describe``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cpu_caps import timed_once
from .native import row_gemm

FORMATS = ("aten", "onednn", "native")
CHOICES = ("auto", *FORMATS)
# rows timed per class: decode on a weight past the last-level cache (64 MiB in fp32), batch and
# prefill on a small model's MLP matrix
DECODE_SHAPE = (8192, 2048)
BATCH_SHAPE = (2048, 1024)
ROWS = (("decode", 1, DECODE_SHAPE), ("batch", 16, BATCH_SHAPE), ("prefill", 128, BATCH_SHAPE),
        ("chunk", 1024, BATCH_SHAPE))
DECODE_TOLERANCE = 1.05        # onednn / aten at decode: no slower (5% timing noise allowed)
CHUNK_TOLERANCE = 1.05         # onednn / aten at a prefill chunk's rows: no slower
BATCH_GAIN = 0.9               # geometric mean onednn / aten over batch + prefill: 10% faster
# native / aten: no slower at 1 row nor at a few rows, within 10%, and 10% faster where the kernel
# is meant to win: float32 at 8 rows, where MKL's small-M GEMM is slow; bfloat16 at 1 row (it
# takes 2 at most, see row_gemm.BF16_MAX_ROWS), where torch's bf16 GEMV reads the weights slowly.
# 10% at 1 row, not 5%: the 1-row product is bandwidth-bound and the two kernels read at the same
# rate (1.01-1.05 side by side on Emerald Rapids, the kernel alone at 0.97-1.0), while native
# linears also make each llama decode layer one native call, which took 15% off SmolLM2's fp32
# decode step at batch 1 there (linear_formats.py); a 5% bar gave that away on timing noise.
NATIVE_DECODE_TOLERANCE = 1.10
NATIVE_BATCH_GAIN = 0.9


def native_rows(dtype: torch.dtype) -> tuple[tuple, str]:
    """The row classes native is timed at for ``dtype`` and the one it must be 10% faster at."""
    batch = min(8, row_gemm.max_rows(dtype))
    return (("decode", 1, DECODE_SHAPE), ("batch", batch, DECODE_SHAPE)), \
        "decode" if dtype == torch.bfloat16 else "batch"

# (format, rows, shape, dtype) -> (aten's seconds, the format's seconds), timed side by side
Timer = Callable[[str, int, tuple[int, int], torch.dtype], tuple[float, float]]
ROUNDS = 6          # calls per format in a side-by-side timing, after a warm-up call each


def unavailable(fmt: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> str | None:
    """Why weights of ``dtype`` on ``device`` cannot be held in ``fmt`` (None: they can)."""
    if fmt not in FORMATS:
        raise ValueError(f"linear_kernel must be one of {', '.join(CHOICES)}, got {fmt!r}")
    if fmt == "aten":
        return None
    if fmt == "native":
        if torch.device(device).type != "cpu":
            return f"device {torch.device(device)}: the native kernel is a CPU kernel"
        if dtype == torch.bfloat16:
            return row_gemm.bf16_unavailable()
        if dtype != torch.float32:
            return f"the native kernels multiply float32 or bfloat16 weights, not {dtype}"
        return row_gemm.unavailable()
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
    """``weight`` [out, in] in ``fmt``'s storage (``aten``, ``native``: itself)."""
    if fmt in ("aten", "native"):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def copies_weight(fmt: str) -> bool:
    """Whether ``fmt``'s storage is a copy of the loaded weight (a tied one is then held twice)."""
    return fmt == "onednn"


def unpack_weight(fmt: str, packed: torch.Tensor) -> torch.Tensor:
    """The dense [out, in] weight back from ``fmt``'s storage."""
    return packed if fmt in ("aten", "native") else packed.to_dense()


def linear(fmt: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ W^T + bias with W stored in ``fmt``."""
    if fmt == "aten":
        return torch.nn.functional.linear(x, packed, bias)
    if fmt == "native":
        return row_gemm.linear(x, packed, bias)
    lead = x.shape[:-1]
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.reshape(*lead, out.shape[-1])


@dataclass(frozen=True)
class LinearPlan:
    format: str
    why: str                                 # the start-up report's explanation

    def describe(self) -> str:
        return f"linears {self.format} [{self.why}]"


def measure_beside_aten(fmt: str, rows: int, shape: tuple[int, int], dtype: torch.dtype,
                        rounds: int = ROUNDS) -> tuple[float, float]:
    """Seconds of one ``aten`` and one ``fmt`` linear of ``rows`` x ``shape`` (out, in) on the same
    random ``dtype`` weight: the two called in turn, in ABBA order, ``rounds`` times each after a
    warm-up call, the fastest call of each. Side by side, a neighbour's burst on a shared machine
    lands on both (timed one after the other, a 64 MiB 1-row product moved between 2.3 and 3.3 ms
    from one timing to the next, and the plan flipped between starts); the alternating order
    cancels what the call before does to the next (a call right after another one over the same
    weight ran up to 3% apart)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g).to(dtype)
    x = torch.randn(rows, shape[1], generator=g).to(dtype)
    sides = [(f, pack_weight(f, w)) for f in ("aten", fmt)]
    best = [math.inf, math.inf]
    with torch.inference_mode():
        for f, packed in sides:
            linear(f, x, packed, None)
        for r in range(rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                f, packed = sides[i]
                t0 = time.perf_counter()
                linear(f, x, packed, None)
                best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


def _cached(fmt: str, rows: int, shape: tuple[int, int], dtype: torch.dtype) -> tuple[float, float]:
    return timed_once(("linear", fmt, rows, shape, dtype), lambda: measure_beside_aten(fmt, rows, shape, dtype))


def _against_aten(fmt: str, classes, timer: Timer, dtype: torch.dtype) -> tuple[dict[str, float], list[str]]:
    """``fmt`` / ``aten`` time per row class, and the timings as report text."""
    ratios, timings = {}, []
    for cls, rows, shape in classes:
        t = dict(zip(("aten", fmt), timer(fmt, rows, shape, dtype)))
        ratios[cls] = t[fmt] / t["aten"]
        timings.append(f"{cls} ({rows} rows, {shape[0]}x{shape[1]}): aten {t['aten'] * 1e3:.2f}ms "
                       f"{fmt} {t[fmt] * 1e3:.2f}ms")
    return ratios, timings


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
    timer = timer or _cached
    threads = torch.get_num_threads()
    candidates, notes = [], []
    why_not = unavailable("onednn", dtype, device)
    if why_not:
        notes.append(f"onednn: {why_not}")
    else:
        ratios, timings = _against_aten("onednn", ROWS, timer, dtype)
        batch = math.sqrt(ratios["batch"] * ratios["prefill"])
        if ratios["decode"] <= DECODE_TOLERANCE and batch <= BATCH_GAIN and ratios["chunk"] <= CHUNK_TOLERANCE:
            candidates.append("onednn")
        notes.append(f"onednn/aten decode {ratios['decode']:.2f} (<= {DECODE_TOLERANCE}), batch+prefill "
                     f"{batch:.2f} (<= {BATCH_GAIN}), chunk {ratios['chunk']:.2f} (<= {CHUNK_TOLERANCE}): "
                     + "; ".join(timings))
    why_not = unavailable("native", dtype, device)
    if why_not:
        notes.append(f"native: {why_not}")
    else:
        classes, gain = native_rows(dtype)
        ratios, timings = _against_aten("native", classes, timer, dtype)
        if max(ratios.values()) <= NATIVE_DECODE_TOLERANCE and ratios[gain] <= NATIVE_BATCH_GAIN:
            candidates.append("native")
        bars = {c: f"<= {NATIVE_BATCH_GAIN if c == gain else NATIVE_DECODE_TOLERANCE}" for c in ratios}
        notes.append(f"native/aten decode {ratios['decode']:.2f} ({bars['decode']}), {classes[1][1]} rows "
                     f"{ratios['batch']:.2f} ({bars['batch']}): " + "; ".join(timings))
    # native wins when it qualifies: its linears also make whole decode layers one native call, and
    # prefill chunks stay on aten (onednn's ran 1.14x aten's at 1024 rows on Sapphire Rapids, and
    # its chunk bar passed or failed with the machine's noise, flipping the plan between starts)
    chosen = "native" if "native" in candidates else candidates[0] if candidates else "aten"
    return LinearPlan(chosen, f"timed: at {threads} threads, " + "; ".join(notes))


__all__ = ["CHOICES", "FORMATS", "LinearPlan", "choose_linear_plan", "copies_weight", "linear", "pack_weight",
           "unavailable", "unpack_weight"]
