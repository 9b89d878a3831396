"""The state-snapshot seam: save, restore and copy a sequence's per-sequence state.

A sequence's state is one row of every slot pool (KDA recurrent + conv state, indexer tail).
Row 0 is the null slot, rows 1..num_slots are sequence slots, and the rows after them are
checkpoint rows. A snapshot is a bit-exact copy of a row (fp32 recurrent state stays fp32), so a
restored sequence continues exactly as if it had computed its prefix itself. The prefix cache
saves checkpoints at page boundaries and restores them into a hit's slot; speculative decoding
copies a slot aside before verifying drafts in an eager step and back to roll rejected drafts
back (and keeps the MTP layer's indexer tail aside while it chains drafts); a verify step in static
graphs keeps the state after each verified token instead (``StepStates``) and copies the accepted
one back.
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


class StepStates:
    """Per-token states of a static verify step (speculative decoding in graphs).

    For every slot-pool row the target model's layers write (``CacheSpec.target_state_rows``), a
    buffer ``[rows, sequences, steps, *entry]``: a verify step of ``steps + 1`` tokens per
    sequence leaves each sequence's state after each of its tokens but the last there
    (``ForwardBatch.step_states``; the kernels compute them with the operations single-token steps
    use). A sequence that kept ``n <= steps`` of its tokens gets its state back by copying step
    ``n - 1`` into its slot: per-position states (vLLM's choice for Mamba-style layers) instead of
    a snapshot and a replay, for ``steps`` state rows per sequence of the largest bucket
    (``CacheSpec.verify_state_bytes_per_sequence``)."""

    def __init__(self, cache: CacheTensors, sequences: int, steps: int):
        spec = cache.spec
        self.rows: dict[str, tuple[int, ...]] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        self.pools: dict[str, torch.Tensor] = {}
        for name, pool in cache.pools.items():
            rows = spec.target_state_rows(name) if spec.pool(name).unit == "slot" else ()
            if rows:
                self.rows[name], self.pools[name] = rows, pool
                self.buffers[name] = torch.zeros(len(rows), sequences, steps, *pool.shape[2:], dtype=pool.dtype,
                                                 device=pool.device)
        self._index = {name: torch.tensor(rows, device=cache.device) for name, rows in self.rows.items()}

    def views(self, pool_rows: dict[str, int]) -> dict[str, torch.Tensor]:
        """One layer's buffers as ``<pool>_steps`` (``pool_rows``: pool -> the layer's row)."""
        return {f"{name}_steps": self.buffers[name][self.rows[name].index(row)]
                for name, row in pool_rows.items() if row in self.rows.get(name, ())}

    def restore(self, sequences: list[int], kept: list[int], slots: list[int]) -> None:
        """Sequence ``sequences[i]`` of the last verify batch kept ``kept[i]`` of its tokens
        (1..steps): its slot ``slots[i]`` gets the state it had after them."""
        if not sequences:
            return
        dev = next(iter(self.buffers.values())).device
        b = torch.tensor(sequences, device=dev)
        j = torch.tensor(kept, device=dev) - 1
        s = torch.tensor(slots, device=dev)
        for name, buf in self.buffers.items():
            self.pools[name][self._index[name][:, None], s] = buf[:, b, j]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())
