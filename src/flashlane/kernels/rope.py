"""Rotary position embedding with interleaved pairs (DeepSeek / GLM convention, spec §2).

Pair ``(2i, 2i+1)`` is rotated by angle ``pos * theta^(-2i/dim)``. The rotated vector is written
de-interleaved (all rotated even members, then all rotated odd members) exactly like the HF
reference, so cached roped keys are bit-comparable with it; queries and keys get the same
permutation, so dot products are those of the interleaved rotation.
"""

from __future__ import annotations

import torch


class RopeCache:
    """cos/sin of every position up to a (lazily grown) capacity, gathered by position."""

    def __init__(self, dim: int, theta: float, capacity: int = 4096):
        if dim <= 0 or dim % 2:
            raise ValueError(f"rope dim must be a positive even number, got {dim}")
        self.dim = dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self._cos = self._sin = torch.empty(0, dim // 2)
        self._capacity = capacity

    def _grow(self, needed: int, device: torch.device) -> None:
        size = max(self._capacity, 1 << (needed - 1).bit_length())
        # same op order as the reference (position.float() * inv_freq, fp32) for bitwise equality
        freqs = torch.arange(size, dtype=torch.float32, device=device)[:, None] * self.inv_freq.to(device)
        self._cos, self._sin = freqs.cos(), freqs.sin()
        self._capacity = size

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``(cos, sin)``, each ``[*positions.shape, dim // 2]``."""
        if torch.compiler.is_compiling():   # no host sync on the largest position inside a graph
            freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
            return freqs.cos(), freqs.sin()
        if positions.numel() == 0:
            empty = torch.empty(*positions.shape, self.dim // 2, device=positions.device)
            return empty, empty
        needed = int(positions.max()) + 1
        if self._cos.shape[0] < needed or self._cos.device != positions.device:
            self._grow(needed, positions.device)
        return self._cos[positions], self._sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of ``x`` ([N, ..., dim]) by per-token ``cos``/``sin`` ([N, dim // 2]).

    The math runs in ``x``'s dtype with cos/sin cast to it, as the reference does.
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c = cos.to(x.dtype).reshape(shape)
    s = sin.to(x.dtype).reshape(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)


def apply_rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (llama): x [N, heads, D] by cos/sin [N, D] in x's dtype:
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``."""
    a, b = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-b, a), dim=-1) * sin[:, None]
