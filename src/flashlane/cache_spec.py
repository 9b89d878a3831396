"""The hybrid cache layout, derived from a ModelConfig in one place (torch-free).

Three pools, all addressed per sequence:
  * latent (paged): one row per MLA/DSA layer (llama: per attention layer, K and V packed);
    every such layer of a sequence shares the sequence's block table.
  * index keys (paged, pooled): one row per *full*-indexer layer only; one pooled key per
    ``kpool`` tokens, addressed through the same block table (page_size % kpool == 0);
    plus a per-sequence tail of the incomplete pool (``kpool`` slots of [key | gate]).
  * state (slots): per KDA layer, recurrent state [H, D, D] fp32 and conv state [3Q, K-1];
    slot 0 is the null slot. The indexer tail lives in the same per-sequence slot.
``analyze`` reads the byte counts from here, the engine allocates from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd

from .config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "bf16": 2, "fp8": 1, "int8": 1}


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
    needs_state_slot: bool                # does a sequence hold a state slot?

    def latent_row(self, layer: int) -> int:
        return self.latent_layers.index(layer)

    def kda_row(self, layer: int) -> int:
        return self.kda_layers.index(layer)

    # ---- sizes -----------------------------------------------------------------------------
    def latent_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        return len(self.latent_layers) * self.latent_dim * DTYPE_BYTES[dtype]

    def index_bytes_per_token(self, dtype: str = "bfloat16") -> float:
        return len(self.index_layers) * self.index_dim * DTYPE_BYTES[dtype] / self.kpool

    def bytes_per_token(self, dtype: str = "bfloat16") -> float:
        return self.latent_bytes_per_token(dtype) + self.index_bytes_per_token(dtype)

    def tail_bytes_per_sequence(self, dtype: str = "bfloat16") -> int:
        if self.kpool <= 1:
            return 0
        return len(self.index_layers) * self.kpool * 2 * self.index_dim * DTYPE_BYTES[dtype]

    def state_bytes_per_sequence(self, dtype: str = "bfloat16") -> int:
        h, dk, dv = self.state_shape
        recurrent = len(self.kda_layers) * h * dk * dv * 4
        conv = len(self.kda_layers) * self.conv_dim * self.conv_width * DTYPE_BYTES[dtype]
        return recurrent + conv + self.tail_bytes_per_sequence(dtype)


def page_multiple(cfg: ModelConfig) -> int:
    """Smallest page size every pool accepts (a pooled key must not straddle pages)."""
    return max(cfg.index_kpool, 1)


def chunk_multiple(cfg: ModelConfig, page_size: int) -> int:
    """Prefill chunk lengths are multiples of lcm(page_size, kpool, 64) (engine.md §a.6)."""
    m = page_size
    for x in (max(cfg.index_kpool, 1), 64):
        m = m * x // gcd(m, x)
    return m


def cache_spec(cfg: ModelConfig, page_size: int = 16) -> CacheSpec:
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
        needs_state_slot=bool(kda_layers) or kpool > 1,
    )
