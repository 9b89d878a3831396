"""``x @ W^T + b`` for up to ``MAX_ROWS`` rows of float32 x through ``row_gemm.cpp`` (AVX2 + FMA;
built a second time with AVX-512 where the CPU has it, ``simd_variants``: the same sums bit for
bit, up to 8 rows per pass over the weights), on the weight as loaded: float32 (``linear``) or
int8 with per-row scales (``int8_linear``: weight-only, or with int8 activations, W8A8); and for
bfloat16 x and weights through ``row_gemm_amx.cpp`` (AMX tiles, up to ``AMX_MAX_ROWS`` rows, its N
split over torch's threads) where the CPU and the OS allow AMX, else ``row_gemm_bf16.cpp``
(AVX512_BF16 dot products, up to ``BF16_MAX_ROWS``) where the CPU has it; both sum in float32 and
round to bf16 once. Faster than torch's GEMM where the rows are few (decode) and batch-invariant;
more rows go to torch. The float32 and int8 kernels are single-threaded: the linear plan only
picks the format where a start-up timing at the engine's thread count finds it faster."""

from __future__ import annotations

import ctypes
import functools

import torch

from ..cpu_caps import CpuCaps, detect_cpu_caps
from .build import OPENMP, load, why_unavailable
from .row_split import team_threads
from .simd_variants import ARCH_FLAGS, VARIANT_FLAGS, Variants
from .simd_variants import avx2_unavailable as cpu_unavailable   # re-exported: every native kernel's CPU needs

MAX_ROWS = 16          # measured: ahead of MKL up to 16 rows, behind it at 32 (fp32, Zen 3, 1 thread)
# bf16: 0.34-0.61x torch's time at 1 row, 0.56-0.89x at 2, 0.80-1.13x at 3 (1 thread, Sapphire
# Rapids, SmolLM2's matrices); with weights that are not in cache, parity at 2 and 1.5-2.4x at 4-16:
# past 2 rows torch's bf16 GEMM (oneDNN, AMX here) wins
BF16_MAX_ROWS = 2
# AMX: 0.25-0.35x torch's time at every row count from 1 to 16, and 0.55-0.85x the dot-product
# kernel's at 1-2 rows (1 thread, Sapphire Rapids, SmolLM2's matrices); 16 rows fill a tile
AMX_MAX_ROWS = 16
AMX_K = 32             # the tile's k depth: K must be a multiple
AMX_BLOCK = 64         # output features per tile pass, the unit of its thread split
AMX_PART = 1 << 18     # weights (features x K) a thread's share should carry at least
BF16_FLAGS = (*ARCH_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512bf16")
BF16_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")
AMX_FLAGS = (*BF16_FLAGS, "-mamx-tile", "-mamx-bf16")
AMX_CPU_FLAGS = ("amx_tile", "amx_bf16")
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]


def bf16_cpu_unavailable(caps: CpuCaps | None = None) -> str | None:
    """Why a CPU with ``caps`` cannot run the bf16 kernel (it needs AVX512_BF16); None: it can."""
    caps = detect_cpu_caps() if caps is None else caps
    missing = [f for f in BF16_CPU_FLAGS if f not in caps.flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


@functools.lru_cache(maxsize=1)
def bf16_unavailable() -> str | None:
    """Why the bf16 kernel cannot run on this machine (None: it can)."""
    return why_unavailable(bf16_cpu_unavailable(), _bf16_function)


def amx_cpu_unavailable(caps: CpuCaps | None = None) -> str | None:
    """Why a CPU with ``caps`` cannot run the AMX kernel (it needs AMX-BF16 and AVX512_BF16); None: it can."""
    caps = detect_cpu_caps() if caps is None else caps
    missing = [f for f in (*BF16_CPU_FLAGS, *AMX_CPU_FLAGS) if f not in caps.flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


@functools.lru_cache(maxsize=1)
def amx_unavailable() -> str | None:
    """Why the AMX kernel cannot run on this machine (None: it can): the CPU, the build, and the
    OS's grant of the tile state (Linux asks a process to request it before its first tile op)."""
    why = why_unavailable(amx_cpu_unavailable(), _amx_function)
    if why is None and load("row_gemm_amx", AMX_FLAGS + OPENMP).amx_enable() != 0:
        why = "the OS refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return why


@functools.lru_cache(maxsize=1)
def _amx_function():
    fn = load("row_gemm_amx", AMX_FLAGS + OPENMP).row_gemm_amx_bf16_split
    fn.argtypes, fn.restype = _ARGS + [ctypes.c_int64, ctypes.c_int64], None
    return fn


@functools.lru_cache(maxsize=1)
def _bf16_function():
    fn = load("row_gemm_bf16", BF16_FLAGS).row_gemm_bf16
    fn.argtypes, fn.restype = _ARGS, None
    return fn


@functools.lru_cache(maxsize=None)
def _library(variant: str) -> ctypes.CDLL:
    """The ``variant`` build, its float32 (``row_gemm_f32``) and int8 (``row_gemm_i8w``,
    ``row_gemm_w8a8``) functions typed."""
    lib = load("row_gemm", VARIANT_FLAGS[variant])
    lib.row_gemm_f32.argtypes, lib.row_gemm_f32.restype = _ARGS, None
    for fn in (lib.row_gemm_i8w, lib.row_gemm_w8a8):
        fn.argtypes, fn.restype = _ARGS[:4] + [ctypes.c_void_p] + _ARGS[4:], None
    return lib


_VARIANTS = Variants(_library)
# unavailable(variant=None): why that build (default: this CPU's) cannot run here (None: it can)
unavailable, best_variant = _VARIANTS.unavailable, _VARIANTS.best


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: torch.dtype) -> bool:
    """Whether the native kernel runs ``x`` against ``weight`` (else the caller's torch path)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (0 < rows <= MAX_ROWS and x.dtype == torch.float32 and weight.dtype == weight_dtype
            and x.device.type == "cpu" and (bias is None or bias.dtype == torch.float32)
            and not tracks_grad(x, weight, bias))


def tracks_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an op on these (a ctypes call cannot be differentiated);
    parameters that require grad are fine under no_grad / inference_mode, as when serving."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _rows(x: torch.Tensor) -> torch.Tensor:
    a = x.reshape(-1, x.shape[-1])
    return a if a.stride(-1) == 1 else a.contiguous()


def _bf16_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Which bf16 kernel takes this call: "amx", "dot" (AVX512_BF16 dot products) or None (torch)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (rows > 0 and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and not tracks_grad(x, weight, bias)):
        return None
    if rows <= AMX_MAX_ROWS and weight.shape[1] % AMX_K == 0 and amx_unavailable() is None:
        return "amx"
    return "dot" if rows <= BF16_MAX_ROWS and bf16_unavailable() is None else None


def max_rows(dtype: torch.dtype) -> int:
    """Rows the native kernel of ``dtype`` takes (more go to torch)."""
    if dtype == torch.bfloat16:
        return AMX_MAX_ROWS if amx_unavailable() is None else BF16_MAX_ROWS
    return MAX_ROWS


def _amx_linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    n, k = w.shape
    _amx_function()(a.data_ptr(), a.shape[0], a.stride(0), w.data_ptr(), n, k, w.stride(0),
                    None if bias is None else bias.data_ptr(), out.data_ptr(), n, AMX_BLOCK,
                    team_threads(-(-n // AMX_BLOCK), -(-AMX_PART // (AMX_BLOCK * k))))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias; the native kernel for float32 CPU tensors of up to
    ``MAX_ROWS`` rows and bfloat16 ones of up to ``max_rows(torch.bfloat16)`` where the CPU has
    AMX or AVX512_BF16, torch's linear otherwise."""
    bf16 = _bf16_kernel(x, weight, bias)
    if bf16 is not None:
        fn, b = _bf16_function() if bf16 == "dot" else None, None if bias is None else bias.float().contiguous()
    elif takes(x, weight, bias, torch.float32):
        fn, b = _library(best_variant()).row_gemm_f32, None if bias is None else bias.contiguous()
    else:
        return torch.nn.functional.linear(x, weight, bias)
    n, k = weight.shape
    a = _rows(x)
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(a.shape[0], n, dtype=x.dtype)
    if fn is None:
        _amx_linear(a, w, b, out)
        return out.reshape(*x.shape[:-1], n)
    fn(a.data_ptr(), a.shape[0], a.stride(0), w.data_ptr(), n, k, w.stride(0),
       None if b is None else b.data_ptr(), out.data_ptr(), n)
    return out.reshape(*x.shape[:-1], n)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                otherwise, activations: str = "float32") -> torch.Tensor:
    """x [..., K] @ (qweight[N, K] * scale[N, None])^T + bias with int8 weights and per-row scales:
    ``activations="float32"`` widens the weights exactly (weight-only int8); ``"int8"`` quantises
    each row of x to int8 first and sums exactly in int32 (dynamic W8A8, equal to
    ``quant_matmul.w8a8_linear``). ``otherwise(x, qweight, scale, bias)`` where the kernel does not
    take the call (more than ``MAX_ROWS`` rows, other dtypes or devices)."""
    if not takes(x, qweight, bias, torch.int8) or scale.dtype != torch.float32:
        return otherwise(x, qweight, scale, bias)
    lib = _library(best_variant())
    fn = {"float32": lib.row_gemm_i8w, "int8": lib.row_gemm_w8a8}[activations]
    n, k = qweight.shape
    a = _rows(x)
    w = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    s = scale.contiguous()
    b = None if bias is None else bias.contiguous()
    out = torch.empty(a.shape[0], n, dtype=torch.float32)
    fn(a.data_ptr(), a.shape[0], a.stride(0), w.data_ptr(), s.data_ptr(), n, k, w.stride(0),
       None if b is None else b.data_ptr(), out.data_ptr(), n)
    return out.reshape(*x.shape[:-1], n)
