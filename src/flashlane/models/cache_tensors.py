"""The paged pools and per-sequence state rows a model forward reads and writes, as the engine
allocated them (page 0 and state slot 0 are the null padding targets)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache_spec import CacheSpec


@dataclass
class CacheTensors:
    """The pool tensors the engine allocates (``engine/cache/pools.py``), by ``PoolSpec`` name;
    models read and write them only through the batch. Rows are indexed through ``spec``
    (layer id -> row). Shapes:
      latent      [latent rows, pages * page_size, latent_dim]
      index_keys  [index rows, pages * page_size // kpool, index_dim]
      index_tail  [index rows, state rows, kpool, 2 * index_dim]  (kI | gI)
      conv        [kda rows, state rows, conv_dim, conv_width]
      recurrent   [kda rows, state rows, H, Dk, Dv], float32
    With an int8 KV cache, ``latent`` and ``index_keys`` are int8 and ``latent_scale`` /
    ``index_keys_scale`` hold their fp32 scales ([rows, entries, groups]); otherwise those are None.
    """

    spec: CacheSpec
    num_pages: int                    # page rows, the null page 0 included
    num_state_rows: int               # slot rows: null slot 0, sequence slots, then checkpoints
    pools: dict[str, torch.Tensor]

    def _get(self, name: str) -> torch.Tensor | None:
        return self.pools.get(name)

    latent = property(lambda self: self._get("latent"))
    index_keys = property(lambda self: self._get("index_keys"))
    latent_scale = property(lambda self: self._get("latent_scale"))
    index_keys_scale = property(lambda self: self._get("index_keys_scale"))
    index_tail = property(lambda self: self._get("index_tail"))
    conv = property(lambda self: self._get("conv"))
    recurrent = property(lambda self: self._get("recurrent"))

    def __post_init__(self):
        # Per-layer views, made once. A compiled step takes each one as its own input and writes
        # it in place; a view it sliced from the stacked pool itself would be written back by
        # copying the whole pool.
        self._layers = {name: [t[i] for i in range(t.shape[0])] for name, t in self.pools.items()}

    def layer(self, name: str, row: int) -> torch.Tensor | None:
        """Row ``row`` (see ``spec``) of pool ``name``, or None when the model has no such pool."""
        views = self._layers.get(name)
        return None if views is None else views[row]

    @property
    def device(self) -> torch.device:
        return next(iter(self.pools.values())).device if self.pools else torch.device("cpu")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pools.values())
