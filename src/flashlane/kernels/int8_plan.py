"""Which int8 kernel runs at which row count, chosen once at start-up per CPU.

The int8 kernels trade places with the number of rows: the packed weight-only kernel wins at
decode (a few rows) and degrades with many, W8A8 needs int8 dot instructions (VNNI/AMX; flashlane's
own AVX2 kernels do without, for up to 16 rows) and pays an activation quantisation, dequantise-then-matmul pays a weight cast that many rows amortise.
So rows fall into three classes and each class gets the fastest kernel among those the CPU
supports, timed once on a representative weight shape (a few milliseconds; cached per shape
class for the process). The choice is reported, never a silent slow path.

The kernels round differently (bf16 activations, int8 activations), so with different kernels
per class a request's numbers depend on the batch it ran in: batched == alone holds only with
one kernel for all classes (``models.quantize`` pins one from ``FLASHLANE_INT8_KERNEL``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cpu_caps import CpuCaps, best_time, timed_once
from .native import row_gemm
from .quant_matmul import KERNELS

METHODS = ("int8", "w8a8")
# class name, rows timed, smallest row count in the class (classes ordered by rows)
ROW_CLASSES = (("decode", 1, 1), ("batch", 16, 8), ("prefill", 128, 64))

Timer = Callable[[str, int, tuple[int, int], torch.dtype], float]   # (kernel, rows, (out, in), x dtype) -> s


def candidates(method: str, caps: CpuCaps, native: bool | None = None) -> tuple[str, ...]:
    """Kernels ``method`` may use on a CPU with ``caps``: weight-only ones always, W8A8 only
    for ``w8a8`` and only with int8 dot instructions, bf16 dequantisation only with native bf16,
    flashlane's native kernels where ``native`` (default: ``caps`` has AVX2 + FMA and the kernels
    build here): weight-only, and for ``w8a8`` its W8A8 one, which needs no int8 dot instructions."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)}, got {method!r}")
    out = ["int8pack", "dequant-bf16" if caps.native_bf16 else "dequant-fp32"]
    if native is None:
        native = row_gemm.cpu_unavailable(caps) is None and row_gemm.unavailable() is None
    if native:
        out.append("native")
    if method == "w8a8" and caps.int8_dot:
        out.append("w8a8")
    if method == "w8a8" and native:      # AVX2 byte products: no VNNI needed
        out.append("w8a8-native")
    return tuple(out)


@dataclass(frozen=True)
class Int8Plan:
    method: str
    kernels: tuple[str, ...]                     # one per ROW_CLASSES entry
    why: str                                     # the start-up report's explanation

    def kernel_for(self, rows: int) -> str:
        name = self.kernels[0]
        for (_, _, lo), k in zip(ROW_CLASSES, self.kernels):
            if rows >= lo:
                name = k
        return name

    def linear(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return KERNELS[self.kernel_for(rows)](x, qweight, scale, bias)

    def by_class(self) -> dict[str, str]:
        return {name: k for (name, _, _), k in zip(ROW_CLASSES, self.kernels)}

    def describe(self) -> str:
        parts = [f"{name} (>= {lo} rows): {k}" for (name, _, lo), k in zip(ROW_CLASSES, self.kernels)]
        return f"{self.method} kernels " + ", ".join(parts) + f" [{self.why}]"


def measure_kernel(kernel: str, rows: int, shape: tuple[int, int], dtype: torch.dtype = torch.float32) -> float:
    """Seconds for one call of ``kernel`` on random ``dtype`` activations of ``rows`` x ``shape``."""
    g = torch.Generator().manual_seed(0)
    n_out, n_in = shape
    q = torch.randint(-127, 128, (n_out, n_in), dtype=torch.int8, generator=g)
    scale = torch.rand(n_out, generator=g) / 127
    x = torch.randn(rows, n_in, generator=g).to(dtype)
    fn = KERNELS[kernel]
    with torch.inference_mode():
        return best_time(lambda: fn(x, q, scale))


def _cached_timer(kernel: str, rows: int, shape: tuple[int, int], dtype: torch.dtype) -> float:
    return timed_once(("int8", kernel, rows, shape, dtype), lambda: measure_kernel(kernel, rows, shape, dtype))


def choose_plan(method: str, caps: CpuCaps, shape: tuple[int, int], device: str = "cpu",
                timer: Timer | None = None, dtype: torch.dtype = torch.float32,
                native: bool | None = None) -> Int8Plan:
    """The fastest supported kernel per row class for weights of ``shape`` (out, in) and
    activations of ``dtype`` (``native``: as for ``candidates``; the native kernel takes float32
    activations only)."""
    names = candidates(method, caps, native if dtype == torch.float32 else False)
    if torch.device(device).type != "cpu":
        return Int8Plan(method, ("int8pack",) * len(ROW_CLASSES), f"device {device}: no CPU kernel choice")
    timer = timer or _cached_timer
    chosen, notes = [], []
    for cls, rows, _ in ROW_CLASSES:
        times = {k: timer(k, rows, shape, dtype) for k in names}
        best = min(times, key=times.get)
        chosen.append(best)
        notes.append(f"{cls}: " + " ".join(f"{k} {t * 1e3:.2f}ms" for k, t in times.items()))
    why = f"cpu {caps.describe()}, timed on {shape[0]}x{shape[1]}: " + "; ".join(notes)
    if method == "w8a8" and not any(k.startswith("w8a8") for k in names):
        why = "no VNNI/AMX int8 dot instructions: w8a8 falls back to weight-only int8; " + why
    return Int8Plan(method, tuple(chosen), why)
