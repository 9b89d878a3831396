"""Cache bytes per token (per pool, per storage format) and state bytes per sequence.

Row geometry (which layers own latent / index-key rows, widths, kpool, state shapes) comes from
``flashlane.cache_spec`` so analyze and the engine cannot disagree. Storage formats:

* ``bf16``: 2 B per value (flashlane's ``kv_cache_dtype`` ``bfloat16``, or ``auto`` on a bf16 model).
* ``fp8``: the serving-stack layout (SGLang / vLLM DSA FP8), not one flashlane allocates: e4m3
  latent values with one fp32 scale per 128 values, the RoPE part of an MLA row kept in bf16
  (GLM-5.x: 512 + 16 + 128 = 656 B per token per layer); indexer keys e4m3 + one fp32 scale per
  128 (132 B per entry); llama K/V e4m3 with a per-tensor scale (1 B per value).
* ``int8``: flashlane's ``kv_cache_dtype`` ``int8``: 1 B per value plus fp32 per-token scales
  (``cache_spec.kv_scale_groups``), the RoPE part included.
bf16 and int8 bytes are read from ``cache_spec`` (the layout the engine allocates); per-pool
numbers for those two are in ``CacheBytes.pool_per_token``.

Per-sequence state (KDA recurrent fp32, KDA conv and indexer tail in the model dtype) does not
grow with context and is reported separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from ..cache_spec import CacheSpec, cache_spec
from ..config import ModelConfig

KV_FORMATS = ("bf16", "fp8", "int8")
ENGINE_KV_DTYPES = {"bf16": "bfloat16", "int8": "int8"}   # analyze format -> engine kv_cache_dtype
GROUP = 128  # values per fp32 scale in the fp8 serving layout


def _check(fmt: str) -> None:
    if fmt not in KV_FORMATS:
        raise ValueError(f"kv dtype {fmt!r} is not one of {', '.join(KV_FORMATS)}")


def engine_spec(cfg: ModelConfig, fmt: str) -> CacheSpec:
    """The engine's layout for an engine format (bf16, int8); page size = kpool (sizes per token
    do not depend on it)."""
    return cache_spec(cfg, page_size=max(cfg.index_kpool, 1), kv_cache_dtype=ENGINE_KV_DTYPES[fmt])


def latent_row_bytes(cfg: ModelConfig, fmt: str) -> float:
    """Bytes one latent-pool row holds per token for one layer."""
    _check(fmt)
    if fmt in ENGINE_KV_DTYPES:
        return engine_spec(cfg, fmt).entry_bytes("latent")
    if cfg.arch == "llama":
        return 2 * cfg.num_kv_heads * cfg.head_dim
    nope, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return nope + 4 * ceil(nope / GROUP) + 2 * rope


def index_entry_bytes(cfg: ModelConfig, fmt: str) -> float:
    """Bytes of one indexer key entry (one token, or one pool of kpool tokens)."""
    _check(fmt)
    if fmt in ENGINE_KV_DTYPES:
        return engine_spec(cfg, fmt).entry_bytes("index_keys")
    dh = cfg.index_head_dim
    return dh + 4 * ceil(dh / GROUP)


@dataclass(frozen=True)
class CacheBytes:
    latent_per_token: dict[str, float]    # by format
    index_per_token: dict[str, float]
    mtp_per_token: dict[str, float]       # extra pool rows of the MTP draft layer(s), when drafting
    pool_per_token: dict[str, dict[str, float]]   # engine formats (bf16, int8): bytes/token per pool
    state_recurrent: int                  # per sequence, fp32
    state_conv: int                       # per sequence, model dtype
    state_index_tail: int                 # per sequence, model dtype
    draft_rollback: int = 0               # per running sequence with speculative decoding on
    verify_state_per_draft: int = 0       # per running sequence and draft token, verify steps in graphs

    def per_token(self, fmt: str) -> float:
        return self.latent_per_token[fmt] + self.index_per_token[fmt]

    @property
    def bytes_per_token(self) -> dict[str, float]:
        return {f: self.per_token(f) for f in KV_FORMATS}

    @property
    def state_per_sequence(self) -> int:
        return self.state_recurrent + self.state_conv + self.state_index_tail

    def per_sequence(self, context: int, fmt: str) -> float:
        """Cache + state of one sequence holding ``context`` tokens (page rounding ignored)."""
        return context * self.per_token(fmt) + self.state_per_sequence


def cache_bytes(cfg: ModelConfig, model_dtype: str = "bfloat16") -> CacheBytes:
    if model_dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"model dtype {model_dtype!r} is not one of bfloat16, float16, float32")
    spec: CacheSpec = cache_spec(cfg, page_size=max(cfg.index_kpool, 1))
    n_lat, n_idx, kpool = len(spec.latent_layers), len(spec.index_layers), spec.kpool
    latent = {f: n_lat * latent_row_bytes(cfg, f) for f in KV_FORMATS}
    index = {f: n_idx * index_entry_bytes(cfg, f) / kpool for f in KV_FORMATS}
    pools = {f: engine_spec(cfg, f).page_bytes_per_token(model_dtype) for f in ENGINE_KV_DTYPES}
    # one source of truth: the engine formats must be exactly what the engine allocates
    for f in ENGINE_KV_DTYPES:
        assert latent[f] + index[f] == engine_spec(cfg, f).bytes_per_token(model_dtype) == sum(pools[f].values())
    mtp = {f: 0.0 for f in KV_FORMATS}
    if cfg.arch != "llama" and cfg.num_mtp_layers:
        mtp = {f: cfg.num_mtp_layers * (latent_row_bytes(cfg, f) + index_entry_bytes(cfg, f) / kpool)
               for f in KV_FORMATS}
    return CacheBytes(
        latent_per_token=latent,
        index_per_token=index,
        mtp_per_token=mtp,
        pool_per_token=pools,
        state_recurrent=spec.recurrent_bytes_per_sequence(),
        state_conv=spec.conv_bytes_per_sequence(model_dtype),
        state_index_tail=spec.tail_bytes_per_sequence(model_dtype),
        draft_rollback=spec.draft_rollback_bytes_per_sequence(model_dtype),
        verify_state_per_draft=spec.verify_state_bytes_per_sequence(1, model_dtype),
    )


def reference_index_bytes_per_token(cfg: ModelConfig, fmt: str = "bf16") -> float:
    """Indexer cache per token if every full layer kept one entry per token (no pooling)."""
    n_idx = len(cfg.full_indexer_layers)
    return n_idx * index_entry_bytes(cfg, fmt)


def hf_reference_index_bytes_per_token(cfg: ModelConfig) -> float:
    """What the transformers reference caches per token per full layer: [kI | gI | valid], bf16."""
    n_idx = len(cfg.full_indexer_layers)
    width = 2 * cfg.index_head_dim + 1 if cfg.index_kpool > 1 else cfg.index_head_dim
    return n_idx * width * 2
