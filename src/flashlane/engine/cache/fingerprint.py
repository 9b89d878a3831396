"""A cheap, deterministic fingerprint of a model's weights (keys the disk tier of the cache)."""

from __future__ import annotations

import hashlib

import torch

_SAMPLE = 4096


def weights_fingerprint(model: torch.nn.Module) -> str:
    """blake2b over every parameter and buffer's name, shape, dtype and a strided sample of its
    values: different weights (or a different quantisation) give a different fingerprint."""
    h = hashlib.blake2b(digest_size=16)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in sorted(tensors, key=lambda x: x[0]):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            step = max(1, flat.numel() // _SAMPLE)
            sample = flat[::step][:_SAMPLE].to("cpu")
            if sample.dtype == torch.bfloat16:
                sample = sample.view(torch.int16)
            h.update(sample.numpy().tobytes())
    return h.hexdigest()
