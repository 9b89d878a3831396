"""Cache bytes per token (per pool, per storage format) and state bytes per sequence.

Row geometry (which layers own latent / index-key rows, widths, kpool, state shapes) comes from
``flashlane.cache_spec`` so analyze and the engine cannot disagree. Storage formats:

* ``bf16``: 2 B per value (what flashlane's engine allocates on GPU/CPU in bfloat16).
* ``fp8``: the serving-stack layout (SGLang / vLLM DSA FP8): e4m3 latent values with one fp32
  scale per 128 values, the RoPE part of an MLA row kept in bf16 (GLM-5.x: 512 + 16 + 128 =
  656 B per token per layer); indexer keys e4m3 + one fp32 scale per 128 (132 B per entry);
  llama K/V e4m3 with a per-tensor scale (1 B per value).
* ``int8``: 1 B per value plus one fp32 scale per 128-value group, RoPE part included.

Per-sequence state (KDA recurrent fp32, KDA conv and indexer tail in the model dtype) does not
grow with context and is reported separately.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from ..cache_spec import CacheSpec, cache_spec
from ..config import ModelConfig

KV_FORMATS = ("bf16", "fp8", "int8")
GROUP = 128  # values per fp32 scale in the quantised formats


def _check(fmt: str) -> None:
    if fmt not in KV_FORMATS:
        raise ValueError(f"kv dtype {fmt!r} is not one of {', '.join(KV_FORMATS)}")


def latent_row_bytes(cfg: ModelConfig, fmt: str) -> float:
    """Bytes one latent-pool row holds per token for one layer."""
    _check(fmt)
    if cfg.arch == "llama":
        dim = 2 * cfg.num_kv_heads * cfg.head_dim
        return {"bf16": 2 * dim, "fp8": dim, "int8": dim + 4 * ceil(dim / GROUP)}[fmt]
    nope, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if fmt == "bf16":
        return 2 * (nope + rope)
    if fmt == "fp8":
        return nope + 4 * ceil(nope / GROUP) + 2 * rope
    return (nope + rope) + 4 * ceil((nope + rope) / GROUP)


def index_entry_bytes(cfg: ModelConfig, fmt: str) -> float:
    """Bytes of one indexer key entry (one token, or one pool of kpool tokens)."""
    _check(fmt)
    dh = cfg.index_head_dim
    return 2 * dh if fmt == "bf16" else dh + 4 * ceil(dh / GROUP)


@dataclass(frozen=True)
class CacheBytes:
    latent_per_token: dict[str, float]    # by format
    index_per_token: dict[str, float]
    mtp_per_token: dict[str, float]       # extra pool rows of the MTP draft layer(s), when drafting
    state_recurrent: int                  # per sequence, fp32
    state_conv: int                       # per sequence, model dtype
    state_index_tail: int                 # per sequence, model dtype

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
    spec: CacheSpec = cache_spec(cfg, page_size=max(cfg.index_kpool, 1))
    n_lat, n_idx, kpool = len(spec.latent_layers), len(spec.index_layers), spec.kpool
    latent = {f: n_lat * latent_row_bytes(cfg, f) for f in KV_FORMATS}
    index = {f: n_idx * index_entry_bytes(cfg, f) / kpool for f in KV_FORMATS}
    # one source of truth: the bf16 numbers must be exactly what the engine allocates
    assert latent["bf16"] + index["bf16"] == spec.bytes_per_token("bfloat16")
    mtp = {f: 0.0 for f in KV_FORMATS}
    if cfg.arch != "llama" and cfg.num_mtp_layers:
        mtp = {f: cfg.num_mtp_layers * (latent_row_bytes(cfg, f) + index_entry_bytes(cfg, f) / kpool)
               for f in KV_FORMATS}
    if model_dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"model dtype {model_dtype!r} is not one of bfloat16, float16, float32")
    return CacheBytes(
        latent_per_token=latent,
        index_per_token=index,
        mtp_per_token=mtp,
        state_recurrent=spec.recurrent_bytes_per_sequence(),
        state_conv=spec.conv_bytes_per_sequence(model_dtype),
        state_index_tail=spec.tail_bytes_per_sequence(model_dtype),
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
