"""Linears on weights kept in a GGUF file's own blocks of 32 (Q4_1, Q8_0), in plain torch.

A block row of ``blocks`` [N, K / 32 * bytes] (uint8, the file's bytes) holds one weight row:
Q4_1 blocks are fp16 ``d``, fp16 ``m`` and 16 bytes of nibbles (weights 0-15 in the low halves,
16-31 in the high), ``w = d * q + m``; Q8_0 blocks are fp16 ``d`` and 32 int8, ``w = d * q``.
The activations are quantised per block of 32 as well (``quantize_activations``), as llama.cpp
does, so a product is ``sum over blocks of d_w * d_x * (q_w . q_x) (+ m_w * s_x)``.

``block_linear`` is the reference every other implementation is tested against (and what runs
where the native kernel, ``kernels/native/block_gemm``, cannot): both sides dequantised, one
float matmul; ``exact_block_linear`` is the same sum in float64 with exact integer block dots.

The engine holds the blocks ``repack``-ed by groups of 8 output rows, the layout the native
kernel reads (see ``block_gemm.cpp``): the same bytes, reordered, so ``unrepack`` gives the file's
blocks back exactly.
"""

from __future__ import annotations

import torch

BLOCK = 32
BYTES = {"q4_1": 20, "q8_0": 34}     # bytes per block of 32 weights
GROUP = 8                             # output rows per repacked group
_SCALES = {"q4_1": 2, "q8_0": 1}      # fp16 scales at the head of a block (d, and m for Q4_1)


def check_blocks(kind: str, blocks: torch.Tensor, in_features: int) -> None:
    if kind not in BYTES:
        raise ValueError(f"GGUF block kind must be one of {', '.join(BYTES)}, got {kind!r}")
    if in_features % BLOCK:
        raise ValueError(f"{kind}: in_features {in_features} is not a multiple of {BLOCK}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != in_features // BLOCK * BYTES[kind]:
        raise ValueError(f"{kind}: blocks must be uint8 [out, {in_features // BLOCK * BYTES[kind]}], "
                         f"got {blocks.dtype} {list(blocks.shape)}")


def _fp16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def unpack(kind: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [N, nb, 32] int16 weights as stored, d [N, nb] fp32, m [N, nb] fp32 or None)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, BYTES[kind])
    d = _fp16(b[..., 0:2])
    if kind == "q8_0":
        return b[..., 2:].contiguous().view(torch.int8).to(torch.int16), d, None
    nibbles = b[..., 4:].to(torch.int16)
    return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1), d, _fp16(b[..., 2:4])


def dequantize(kind: str, blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] the blocks stand for (equal to ``gguf.quants.dequantize``)."""
    q, d, m = unpack(kind, blocks)
    w = d[..., None] * q.float()
    if m is not None:
        w = w + m[..., None]
    return w.reshape(blocks.shape[0], -1).to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, nb, 32] int8, d [M, nb], s [M, nb] = d * sum(q)): per block,
    d = amax / 127, q = round-half-even(x / d) clamped to +-127 (0 for an all-zero block)."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    d = xb.abs().amax(-1) / 127.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d[..., None] > 0, (xb / safe[..., None]).round().clamp(-127, 127), torch.zeros_like(xb))
    return q.to(torch.int8), d, d * q.sum(-1)


def repack(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """File blocks [N, nb * bytes] -> groups [ceil(N / 8), nb * 8 * bytes]: per group and block,
    the 8 rows' scales (fp16 d's, then m's), then the quants as 32-byte vectors of 4 consecutive
    bytes per row (rows past N are zero)."""
    n = blocks.shape[0]
    groups = -(-n // GROUP)
    b = torch.zeros(groups * GROUP, blocks.shape[1], dtype=torch.uint8)
    b[:n] = blocks
    b = b.reshape(groups, GROUP, -1, BYTES[kind]).transpose(1, 2)        # [G, nb, 8, bytes]
    head = 2 * _SCALES[kind]
    scales = b[..., :head].reshape(*b.shape[:3], _SCALES[kind], 2).transpose(2, 3)   # [G, nb, s, 8, 2]
    quads = b[..., head:].reshape(*b.shape[:3], -1, 4).transpose(2, 3)              # [G, nb, t, 8, 4]
    out = torch.cat([scales.reshape(*b.shape[:2], -1), quads.reshape(*b.shape[:2], -1)], dim=-1)
    return out.reshape(groups, -1).contiguous()


def unrepack(kind: str, packed: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of ``repack``: the file's blocks [rows, nb * bytes]."""
    groups = packed.shape[0]
    b = packed.reshape(groups, -1, GROUP * BYTES[kind])
    head = 2 * _SCALES[kind] * GROUP
    scales = b[..., :head].reshape(groups, -1, _SCALES[kind], GROUP, 2).transpose(2, 3)   # [G, nb, 8, s, 2]
    quads = b[..., head:].reshape(groups, -1, (BYTES[kind] - head // GROUP) // 4, GROUP, 4).transpose(2, 3)
    blocks = torch.cat([scales.reshape(*scales.shape[:3], -1), quads.reshape(*quads.shape[:3], -1)], dim=-1)
    return blocks.transpose(1, 2).reshape(groups * GROUP, -1)[:rows].contiguous()


def block_linear(x: torch.Tensor, kind: str, blocks: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) with block-quantised activations, as one float matmul."""
    rows = x.reshape(-1, x.shape[-1])
    q, d, _ = quantize_activations(rows)
    xq = (q.float() * d[..., None]).reshape(rows.shape)
    out = torch.nn.functional.linear(xq, dequantize(kind, blocks), None if bias is None else bias.float())
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def exact_block_linear(x: torch.Tensor, kind: str, blocks: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float64 with each block's integer dot exact (tests; small shapes)."""
    rows = x.reshape(-1, x.shape[-1])
    qx, dx, sx = quantize_activations(rows)
    qw, dw, mw = unpack(kind, blocks)
    isum = torch.einsum("mbk,nbk->mnb", qx.double(), qw.double())
    out = (isum * dx.double()[:, None, :] * dw.double()[None]).sum(-1)
    if mw is not None:
        out = out + (sx.double()[:, None, :] * mw.double()[None]).sum(-1)
    if bias is not None:
        out = out + bias.double()
    return out.reshape(*x.shape[:-1], -1)


__all__ = ["BLOCK", "BYTES", "GROUP", "block_linear", "check_blocks", "dequantize", "exact_block_linear",
           "quantize_activations", "repack", "unpack", "unrepack"]
