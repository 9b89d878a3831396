"""mHC through ``mhc_weights.cpp``: ``kernels.mhc.hc_pre`` (the normed streams, the per-token
weights' sigmoid / softmax / Sinkhorn part, ~120 torch ops on tensors of a few floats, and the
collapse) and ``hc_post``, for float32 and bfloat16 streams. Each returns None where the inputs
are not its case (another device or dtype, inside a compiled graph, autograd recording, or the
kernel unavailable) and the caller runs the torch formulas. A prefill's tokens are split over
torch's OpenMP team (``parallel.h``); every token is computed on its own, so the numbers do not
depend on the split."""

from __future__ import annotations

import ctypes
import functools

import torch

from .. import mhc
from . import row_gemm
from .build import OPENMP, load, why_unavailable
from .row_split import team_threads_by_values

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=1)
def _functions():
    lib = load("mhc_weights", row_gemm.ARCH_FLAGS + OPENMP)
    weights = lib.mhc_weights_f32
    # per streams dtype
    post = {torch.float32: lib.mhc_post_f32, torch.bfloat16: lib.mhc_post_bf16}
    norm = {torch.float32: lib.mhc_norm_f32, torch.bfloat16: lib.mhc_norm_bf16}
    collapse = {torch.float32: lib.mhc_collapse_f32, torch.bfloat16: lib.mhc_collapse_bf16}
    weights.argtypes, weights.restype = [_P, _I, _I, _P, _P, ctypes.c_float, _I, _P, _P, _P, _I], None
    for fn in post.values():
        fn.argtypes, fn.restype = [_P, _P, _P, _P, _I, _I, _I, _P, _I], None
    for fn in norm.values():
        fn.argtypes, fn.restype = [_P, _I, _I, ctypes.c_float, _P, _I], None
    for fn in collapse.values():
        fn.argtypes, fn.restype = [_P, _P, _I, _I, _I, _P, _I], None
    return weights, post, norm, collapse


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why the kernels cannot run here (None: they can)."""
    return why_unavailable(row_gemm.cpu_unavailable(), _functions)


def _eager(*tensors: torch.Tensor) -> bool:
    return (all(t.device.type == "cpu" for t in tensors) and not torch.compiler.is_compiling()
            and not row_gemm.tracks_grad(*tensors) and unavailable() is None)


def mhc_weights(mixed: torch.Tensor, n: int, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
                iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """mixed [N, (2 + n) n] float32 -> (pre [N, n], post [N, n], comb [N, n, n]), or None."""
    if mixed.dim() != 2 or mixed.shape[1] != (2 + n) * n or iters < 1 or not _eager(mixed, base, scale):
        return None
    return _weights(mixed, n, base, scale, hc_eps, iters)


def _weights(mixed, n, base, scale, hc_eps, iters):
    rows = mixed.float().contiguous()
    b, s = base.float().contiguous(), scale.float().contiguous()
    count = rows.shape[0]
    pre, post = torch.empty(count, n), torch.empty(count, n)
    comb = torch.empty(count, n, n)
    # a token's weights: about one multiply-add per entry and Sinkhorn iteration
    _functions()[0](rows.data_ptr(), count, n, b.data_ptr(), s.data_ptr(), hc_eps, iters, pre.data_ptr(),
                    post.data_ptr(), comb.data_ptr(), team_threads_by_values(count, rows.shape[1] * iters))
    return pre, post, comb


@torch.library.custom_op("flashlane::mhc_weights", mutates_args=())
def weights_op(mixed: torch.Tensor, n: int, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
               iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_weights`` as one op a compiled graph calls as it is: traced, the Sinkhorn iterations
    unroll into ~140 tiny ops per mHC, half of a decoder layer's graph and of its compile time.
    Where the kernel cannot run (another device, not built), the torch formulas."""
    if mixed.device.type == "cpu" and iters >= 1 and unavailable() is None:
        return _weights(mixed, n, base, scale, hc_eps, iters)   # hc_pre checked the shapes when traced
    return tuple(t.contiguous() for t in mhc.hc_weights(mixed.float(), n, base, scale, hc_eps, iters))


@weights_op.register_fake
def _(mixed, n, base, scale, hc_eps, iters):
    count = mixed.shape[0]
    return (mixed.new_empty(count, n, dtype=torch.float32), mixed.new_empty(count, n, dtype=torch.float32),
            mixed.new_empty(count, n, n, dtype=torch.float32))


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``kernels.mhc.hc_pre`` for float32 or bfloat16 streams [N, n, H]: the RMS-normed flat
    streams, the per-token weights and the collapse natively, the mixed projection by aten's
    float32 matmul between them -> (collapsed [N, H] in the streams' dtype, post, comb), or None."""
    dtype = streams.dtype
    if streams.dim() != 3 or dtype not in (torch.float32, torch.bfloat16) or not _eager(streams, fn, base, scale):
        return None
    count, n, h = streams.shape
    if fn.shape != ((2 + n) * n, n * h) or base.shape != ((2 + n) * n,) or scale.shape != (3,):
        return None            # the torch formula raises the error naming the shapes
    x = streams.contiguous()
    _, _, norm, collapse = _functions()
    flat = torch.empty(count, n * h, dtype=torch.float32)
    norm[dtype](x.data_ptr(), count, n * h, norm_eps, flat.data_ptr(), team_threads_by_values(count, n * h))
    weights = mhc_weights(torch.nn.functional.linear(flat, fn.float()), n, base, scale, hc_eps, sinkhorn_iters)
    if weights is None:
        return None
    pre, post, comb = weights
    collapsed = torch.empty(count, h, dtype=dtype)
    collapse[dtype](x.data_ptr(), pre.data_ptr(), count, n, h, collapsed.data_ptr(),
                    team_threads_by_values(count, n * h))
    return collapsed, post, comb


def mhc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
             comb: torch.Tensor) -> torch.Tensor | None:
    """``kernels.mhc.hc_post`` for float32 or bfloat16 streams (y of the same dtype): y [N, H],
    streams [N, n, H], post [N, n], comb [N, n, n] -> ``post (outer) y + comb^T X`` [N, n, H] in
    the streams' dtype, or None. In bf16 it rounds where the formula's bf16 ops round."""
    dtype = streams.dtype
    if (streams.dim() != 3 or dtype not in (torch.float32, torch.bfloat16) or y.dtype != dtype
            or y.shape != (streams.shape[0], streams.shape[2]) or post.shape != streams.shape[:2]
            or comb.shape != (*streams.shape[:2], streams.shape[1]) or not _eager(y, streams, post, comb)):
        return None
    count, n, h = streams.shape
    x, yc = streams.contiguous(), y.contiguous()
    p, c = post.to(dtype).float().contiguous(), comb.to(dtype).float().contiguous()
    out = torch.empty(count, n, h, dtype=dtype)
    _functions()[1][dtype](yc.data_ptr(), x.data_ptr(), p.data_ptr(), c.data_ptr(), count, n, h, out.data_ptr(),
                           team_threads_by_values(count, n * n * h))
    return out
