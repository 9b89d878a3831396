"""Allocate the pool tensors described by ``CacheSpec.pools()`` (the engine owns them)."""

from __future__ import annotations

import torch

from ...cache_spec import CacheSpec
from ...models.cache_tensors import CacheTensors

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in TORCH_DTYPES.items()}[dtype]


def allocate_pools(spec: CacheSpec, num_pages: int, num_state_rows: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> CacheTensors:
    """Zeroed pools: ``num_pages`` page rows and ``num_state_rows`` slot rows (both counting the
    null entry 0). Slot pools are left out when the model keeps no per-sequence state."""
    pools = {}
    for p in spec.pools():
        units = num_pages if p.unit == "page" else num_state_rows
        if units == 0:
            continue
        dt = TORCH_DTYPES[p.dtype] if p.dtype else dtype
        pools[p.name] = torch.zeros(p.shape(units), dtype=dt, device=device)
    return CacheTensors(spec, num_pages, num_state_rows, pools)
