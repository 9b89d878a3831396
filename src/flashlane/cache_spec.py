"""The hybrid cache layout, derived from a ModelConfig in one place (torch-free).

Three pools, all addressed per sequence:
  * latent (paged): one row per MLA/DSA layer (llama: per attention layer, K and V packed);
    every such layer of a sequence shares the sequence's block table.
  * index keys (paged, pooled): one row per *full*-indexer layer only; one pooled key per
    ``kpool`` tokens, addressed through the same block table (page_size % kpool == 0);
    plus a per-sequence tail of the incomplete pool (``kpool`` slots of [key | gate]).
  * state (slots): per KDA layer, recurrent state [H, D, D] fp32 and conv state [3Q, K-1];
    slot 0 is the null slot. The indexer tail lives in the same per-sequence slot.
  * MTP (speculative decoding with the model's next-token-prediction layer only): the MTP layer
    is one more DSA layer with a full indexer (a latent row, an index row, a tail). The MTP entry
    of a prefix hit's last position depends on the token *after* the hit, so it is recomputed:
    ``mtp_hidden`` keeps, per page, the target's final hidden state at the page's last token,
    and with pooled index keys ``mtp_ring`` keeps the MTP indexer's ``[key | gate]`` of the
    page's other ``kpool - 1`` last tokens, from which that last pool's key is rebuilt.
``pools()`` is the one description of every pool tensor (name, unit, shape, dtype): the engine
allocates from it, budget planning and ``analyze`` read their byte counts from it. State-slot
pools also hold prefix-cache checkpoints (extra rows of the same tensors).

KV cache dtype (``kv_dtype``, the ``kv_cache_dtype`` engine argument) applies to the two paged
pools (latent/KV and pooled index keys): None = the model dtype, ``bfloat16``, or ``int8``.
int8 is symmetric with fp32 scales kept in their own page pools (``latent_scale``,
``index_keys_scale``: one scale per token per group of a row, see ``kv_scale_groups``), so
pages and scales are allocated, budgeted, exported and reloaded together. fp32 scales cost
4 B next to rows of hundreds of bytes, and a bf16 scale (8-bit mantissa) would add a rounding
error as large as half an int8 step on top of it. Per-sequence slot pools are not quantised:
the KDA recurrent state stays fp32, the KDA conv state and the indexer tail ring (the raw
[key | gate] of a still-incomplete pool, at most ``kpool`` tokens) stay in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd, prod

from .config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "bf16": 2, "fp8": 1, "int8": 1}
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8")


@dataclass(frozen=True)
class PoolSpec:
    """One pool tensor: ``[rows, units * per_unit, *entry]``; a unit is a page or a state slot.

    ``dtype`` None means the cache dtype (the model's); otherwise a fixed dtype name."""

    name: str
    unit: str                         # "page" | "slot"
    rows: int                         # layer rows
    per_unit: int                     # entries per unit (tokens per page, pools per page, 1 per slot)
    entry: tuple[int, ...]            # shape of one entry
    dtype: str | None = None
    scale_of: str | None = None       # this pool holds the int8 scales of pool ``scale_of``

    def dtype_name(self, cache_dtype: str) -> str:
        return self.dtype or cache_dtype

    def shape(self, units: int) -> tuple[int, ...]:
        return (self.rows, units * self.per_unit, *self.entry)

    def bytes_per_unit(self, cache_dtype: str) -> int:
        return self.rows * self.per_unit * prod(self.entry) * DTYPE_BYTES[self.dtype_name(cache_dtype)]


@dataclass(frozen=True)
class CacheSpec:
    page_size: int
    latent_layers: tuple[int, ...]        # layer id per latent-pool row
    latent_dim: int                       # values per token per latent row
    index_layers: tuple[int, ...]         # full-indexer layer id per index-pool row
    index_row_of: dict                    # DSA layer id -> index row it reads (shared -> previous full)
    index_dim: int                        # pooled key width (indexer head dim)
    kpool: int
    kda_layers: tuple[int, ...]           # layer id per state-pool row
    conv_dim: int                         # 3 * linear_num_heads * linear_head_dim
    conv_width: int                       # kernel - 1 pre-conv inputs kept
    state_shape: tuple[int, int, int]     # (heads, key dim, value dim), fp32
    kv_dtype: str | None = None           # paged pools' storage: None (model dtype) | bfloat16 | int8
    latent_groups: int = 1                # int8 scales per token per latent row
    mtp_layers: tuple[int, ...] = ()      # MTP layer ids held in the latent / index pools (drafting on)
    hidden_dim: int = 0                   # width of an ``mtp_hidden`` entry (0 without MTP)

    def latent_row(self, layer: int) -> int:
        return self.latent_layers.index(layer)

    def kda_row(self, layer: int) -> int:
        return self.kda_layers.index(layer)

    def index_row(self, layer: int) -> int:
        """The index-pool row DSA layer ``layer`` reads (a shared-indexer layer: its full one's).
        A method, not a subscript at the call site: a compiled layer then does not guard on the id."""
        return self.index_row_of[layer]

    # ---- the pools ---------------------------------------------------------------------------
    def pools(self) -> tuple[PoolSpec, ...]:
        """Every pool tensor the cache holds; empty pools (no rows) are left out."""
        return tuple(p for p in self._all_pools() if p.rows)

    def _all_pools(self) -> list[PoolSpec]:
        n_kda, n_idx, n_lat = len(self.kda_layers), len(self.index_layers), len(self.latent_layers)
        return [
            *self._kv_pools("latent", n_lat, self.page_size, self.latent_dim, self.latent_groups),
            *self._kv_pools("index_keys", n_idx, self.page_size // self.kpool, self.index_dim, 1),
            PoolSpec("index_tail", "slot", n_idx if self.kpool > 1 else 0, 1, (self.kpool, 2 * self.index_dim)),
            PoolSpec("conv", "slot", n_kda, 1, (self.conv_dim, self.conv_width)),
            PoolSpec("recurrent", "slot", n_kda, 1, self.state_shape, "float32"),
            PoolSpec("mtp_hidden", "page", 1 if self.mtp_layers else 0, 1, (self.hidden_dim,)),
            PoolSpec("mtp_ring", "page", 1 if self.mtp_layers and self.kpool > 1 else 0, max(self.kpool - 1, 1),
                     (2 * self.index_dim,)),
        ]

    def _kv_pools(self, name: str, rows: int, per_unit: int, dim: int, groups: int) -> list[PoolSpec]:
        """A paged pool in the KV cache dtype, plus its scale pool when that dtype is int8."""
        data = PoolSpec(name, "page", rows, per_unit, (dim,), self.kv_dtype)
        if self.kv_dtype != "int8":
            return [data]
        return [data, PoolSpec(f"{name}_scale", "page", rows, per_unit, (groups,), "float32", scale_of=name)]

    def pool(self, name: str) -> PoolSpec | None:
        return next((p for p in self.pools() if p.name == name), None)

    def kv_dtype_name(self, model_dtype: str) -> str:
        """What the paged pools store, ``auto`` resolved (a part of every prefix-cache key)."""
        return self.kv_dtype or model_dtype

    def entry_bytes(self, name: str, dtype: str = "bfloat16") -> int:
        """Bytes of one entry of one row of pool ``name``, its scales included (rows may be 0)."""
        return sum(prod(p.entry) * DTYPE_BYTES[p.dtype_name(dtype)] for p in self._all_pools()
                   if name in (p.name, p.scale_of))

    def page_bytes_per_token(self, dtype: str = "bfloat16") -> dict[str, float]:
        """Bytes per token of every paged pool (scale pools listed on their own)."""
        return {p.name: p.bytes_per_unit(dtype) / self.page_size for p in self.pools() if p.unit == "page"}

    @property
    def needs_state_slot(self) -> bool:
        """Does a sequence hold a per-sequence state slot (KDA state or an indexer tail)?"""
        return any(p.unit == "slot" for p in self.pools())

    # ---- sizes -----------------------------------------------------------------------------
    def _unit_bytes(self, unit: str, dtype: str, names: tuple[str, ...] | None = None) -> int:
        return sum(p.bytes_per_unit(dtype) for p in self.pools()
                   if p.unit == unit and (names is None or p.name in names or p.scale_of in names))

    def bytes_per_page(self, dtype: str = "bfloat16") -> int:
        return self._unit_bytes("page", dtype)

    def bytes_per_slot(self, dtype: str = "bfloat16") -> int:
        return self._unit_bytes("slot", dtype)

    def draft_rollback_bytes_per_sequence(self, dtype: str = "bfloat16") -> int:
        """Speculative decoding: the state a running sequence keeps aside while its drafts are
        verified in an eager step (one more state row, whatever the number of drafts: rejected
        drafts are rolled back by restoring it and replaying the accepted tokens)."""
        return self.bytes_per_slot(dtype)

    def target_state_rows(self, pool: str) -> tuple[int, ...]:
        """The rows of slot pool ``pool`` the target model's layers write (the MTP layer's
        indexer tail is the drafter's own)."""
        if pool == "index_tail" and self.kpool > 1:
            return tuple(r for r, layer in enumerate(self.index_layers) if layer not in self.mtp_layers)
        if pool in ("conv", "recurrent"):
            return tuple(range(len(self.kda_layers)))
        return ()

    def verify_state_bytes_per_sequence(self, num_draft_tokens: int, dtype: str = "bfloat16") -> int:
        """Speculative decoding in static graphs: a verify step of 1 + k tokens keeps a
        sequence's state after each of its tokens but the last (k states of every row the target
        model's stateful layers write), and a rejection copies the accepted one back instead of
        replaying (``engine.cache.snapshots.StepStates``); per running sequence of the largest
        graph bucket."""
        return num_draft_tokens * sum(p.bytes_per_unit(dtype) // p.rows * len(self.target_state_rows(p.name))
                                      for p in self.pools() if p.unit == "slot")

    def mtp_bytes_per_token(self, dtype: str = "bfloat16") -> float:
        """Cache bytes per token the MTP layer adds: its latent and pooled index rows and the
        target hidden state saved per page (0 when the engine does not draft with MTP)."""
        if not self.mtp_layers:
            return 0.0
        n = len(self.mtp_layers)
        saved = sum(p.bytes_per_unit(dtype) for p in self.pools() if p.name in ("mtp_hidden", "mtp_ring"))
        return (n * self.entry_bytes("latent", dtype) + n * self.entry_bytes("index_keys", dtype) / self.kpool
                + saved / self.page_size)

    def layout_key(self) -> str:
        """Which pools, with how many layer rows: part of every prefix-cache key, so pages of an
        engine with the MTP layer's rows never meet one without them."""
        return ",".join(f"{p.name}:{p.rows}" for p in self.pools())

    def latent_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        return self._unit_bytes("page", dtype, ("latent",)) // self.page_size

    def index_bytes_per_token(self, dtype: str = "bfloat16") -> float:
        return self._unit_bytes("page", dtype, ("index_keys",)) / self.page_size

    def bytes_per_token(self, dtype: str = "bfloat16") -> float:
        return self.bytes_per_page(dtype) / self.page_size

    def tail_bytes_per_sequence(self, dtype: str = "bfloat16") -> int:
        return self._unit_bytes("slot", dtype, ("index_tail",))

    def recurrent_bytes_per_sequence(self) -> int:
        return self._unit_bytes("slot", "float32", ("recurrent",))

    def conv_bytes_per_sequence(self, dtype: str = "bfloat16") -> int:
        return self._unit_bytes("slot", dtype, ("conv",))

    def state_bytes_per_sequence(self, dtype: str = "bfloat16") -> int:
        return self.bytes_per_slot(dtype)


def chunk_multiple(cfg: ModelConfig, page_size: int) -> int:
    """Prefill chunk lengths are multiples of lcm(page_size, kpool, 64) (engine.md §a.6)."""
    m = page_size
    for x in (max(cfg.index_kpool, 1), 64):
        m = m * x // gcd(m, x)
    return m


def cache_spec(cfg: ModelConfig, page_size: int = 16, kv_cache_dtype: str = "auto", mtp: bool = False) -> CacheSpec:
    """The layout for ``cfg``; ``kv_cache_dtype`` is one of ``KV_CACHE_DTYPES``; ``mtp``: the
    engine drafts with the model's MTP layer, whose cache rows are then held too."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    kpool = max(cfg.index_kpool, 1)
    if page_size <= 0 or page_size % kpool:
        raise ValueError(f"page_size ({page_size}) must be a positive multiple of index_kpool ({kpool})")
    if cfg.arch == "llama":
        latent_layers = tuple(range(cfg.num_layers))
        latent_dim = 2 * cfg.num_kv_heads * cfg.head_dim
    else:
        latent_layers = tuple(cfg.layers_of("dsa"))
        latent_dim = cfg.mla_cache_dim
    index_layers = tuple(cfg.full_indexer_layers)
    index_row_of: dict[int, int] = {}
    last_full = None
    for i in range(cfg.num_layers):
        if cfg.indexer_types[i] == "full":
            last_full = index_layers.index(i)
            index_row_of[i] = last_full
        elif cfg.indexer_types[i] == "shared":
            if last_full is None:
                raise ValueError(f"layer {i} shares an indexer but no full indexer layer comes before it")
            index_row_of[i] = last_full
    mtp_layers: tuple[int, ...] = ()
    if mtp:
        if cfg.arch == "llama" or cfg.num_mtp_layers < 1:
            raise ValueError(f"this {cfg.arch} model has no MTP layers (num_nextn_predict_layers = "
                             f"{cfg.num_mtp_layers}): it cannot draft with method 'mtp'")
        mtp_layers = (cfg.num_layers,)
        latent_layers += mtp_layers
        index_layers += mtp_layers
        index_row_of[cfg.num_layers] = len(index_layers) - 1
    kda_layers = tuple(cfg.layers_of("kda"))
    qkv = cfg.kda_qkv_dim
    return CacheSpec(
        page_size=page_size,
        latent_layers=latent_layers,
        latent_dim=latent_dim,
        index_layers=index_layers,
        index_row_of=index_row_of,
        index_dim=cfg.index_head_dim,
        kpool=kpool,
        kda_layers=kda_layers,
        conv_dim=3 * qkv if kda_layers else 0,
        conv_width=max(cfg.conv_kernel - 1, 0) if kda_layers else 0,
        state_shape=(cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim) if kda_layers else (0, 0, 0),
        kv_dtype=None if kv_cache_dtype == "auto" else kv_cache_dtype,
        latent_groups=kv_scale_groups(cfg),
        mtp_layers=mtp_layers,
        hidden_dim=cfg.hidden_size if mtp_layers else 0,
    )


def kv_scale_groups(cfg: ModelConfig) -> int:
    """int8 scales per token per latent row. llama rows pack [K | V] of every KV head: one scale
    per head of K and of V (heads differ in range, RoPE'd keys carry outlier channels). An MLA
    row ``[ckv | k_rope]`` gets one scale; index keys always get one."""
    return 2 * cfg.num_kv_heads if cfg.arch == "llama" else 1
