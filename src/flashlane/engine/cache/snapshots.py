"""The state-snapshot seam: save, restore and copy a sequence's per-sequence state.

A sequence's state is one row of every slot pool (KDA recurrent + conv state, indexer tail).
Row 0 is the null slot, rows 1..num_slots are sequence slots, and the rows after them are
checkpoint rows. A snapshot is a bit-exact copy of a row (fp32 recurrent state stays fp32), so a
restored sequence continues exactly as if it had computed its prefix itself. The prefix cache
saves checkpoints at page boundaries and restores them into a hit's slot; speculative decoding
copies a slot aside before verifying drafts and back to roll rejected drafts back (and keeps the
MTP layer's indexer tail aside while it chains drafts).
"""

from __future__ import annotations

import torch

from ...models.cache_tensors import CacheTensors


class StateSnapshots:
    def __init__(self, cache: CacheTensors):
        spec = cache.spec
        self.pools = {name: t for name, t in cache.pools.items() if spec.pool(name).unit == "slot"}

    def copy(self, src: int, dst: int, layer_rows: dict[str, list[int]] | None = None) -> None:
        """Row ``src`` -> row ``dst`` in every slot pool (save: slot -> checkpoint; restore: back);
        ``layer_rows``: only these layer rows of these pools (e.g. one layer's indexer tail)."""
        if layer_rows is None:
            for t in self.pools.values():
                t[:, dst].copy_(t[:, src])
            return
        for name, rows in layer_rows.items():
            t = self.pools[name]
            for r in rows:
                t[r, dst].copy_(t[r, src])

    def clear(self, row: int) -> None:
        """Zero a row (stale state is a classic bug)."""
        for t in self.pools.values():
            t[:, row].zero_()

    def export(self, row: int) -> dict[str, torch.Tensor]:
        """A detached CPU copy of a row, for a lower cache tier."""
        return {name: t[:, row].to("cpu", copy=True) for name, t in self.pools.items()}

    def load(self, data: dict[str, torch.Tensor], row: int) -> None:
        """Write an exported row back (shapes and dtypes must match this cache's)."""
        if set(data) != set(self.pools):
            raise ValueError(f"snapshot holds pools {sorted(data)}, the cache has {sorted(self.pools)}")
        for name, t in self.pools.items():
            t[:, row].copy_(data[name])
