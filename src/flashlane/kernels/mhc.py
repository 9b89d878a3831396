"""Manifold-constrained hyper-connections (mHC) on residual streams ``X`` [N, n, H].

``hc_pre`` computes the collapse / expand / mix weights from the streams and collapses them into
the sublayer input; ``hc_post`` expands the sublayer output back and mixes in the residual:
``X'[j] = post[j] * y + sum_i comb[i, j] * X[i]``. Weight math is fp32 (glm5-architecture §1.3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Column step first, then ``iters - 1`` (row, column) rounds; ends on a column step."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_weights(mixed: torch.Tensor, n: int, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
               sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token weights from the mixed projection [N, (2+n)n] fp32: (pre [N, n], post [N, n],
    comb [N, n, n]), all fp32."""
    a_pre, a_post, a_comb = mixed.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.float().split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = torch.sigmoid(a_pre * s_pre + b_pre) + hc_eps
    post = 2 * torch.sigmoid(a_post * s_post + b_post)
    comb = torch.softmax((a_comb * s_comb + b_comb).unflatten(-1, (n, n)), dim=-1) + hc_eps
    return pre, post, sinkhorn(comb, sinkhorn_iters, hc_eps)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int, weights=hc_weights
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [N, n, H] -> (collapsed [N, H] in the streams' dtype, post [N, n] fp32, comb [N, n, n] fp32).

    ``fn`` [(2+n)n, n*H], ``base`` [(2+n)n], ``scale`` [3] = (pre, post, comb) scales; ``weights``
    computes them as ``hc_weights`` does (a backend's kernel of it).
    """
    if streams.dim() != 3:
        raise ValueError(f"hc_pre: streams must be [tokens, n_streams, hidden], got {tuple(streams.shape)}")
    n = streams.shape[1]
    if fn.shape != ((2 + n) * n, n * streams.shape[2]) or base.shape != ((2 + n) * n,) or scale.shape != (3,):
        raise ValueError(f"hc_pre: fn {tuple(fn.shape)} / base {tuple(base.shape)} / scale {tuple(scale.shape)} "
                         f"do not fit {n} streams of width {streams.shape[2]}")
    flat = streams.reshape(streams.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixed = F.linear(flat, fn.float())
    pre, post, comb = weights(mixed, n, base, scale, hc_eps, sinkhorn_iters)
    collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
    return collapsed, post, comb


def hc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [N, H], streams [N, n, H] -> new streams ``post (outer) y + comb^T X`` in the streams' dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


__all__ = ["sinkhorn", "hc_pre", "hc_post", "hc_weights"]
