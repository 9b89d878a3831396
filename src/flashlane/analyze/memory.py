"""Memory per device for a weight dtype and a TP x DP layout (EP over all devices).

Layout model (printed as assumptions): a replica has ``tp * dp`` devices. Attention-side weights
(embedding, LM head, MLA / KDA / GQA / indexer projections, dense FFN, shared experts) are split
``tp`` ways and replicated over the ``dp`` attention groups; routed experts are spread over all
devices (EP = tp * dp); norms, mHC and routers are replicated. Each tp group serves its own
sequences: the MLA latent and indexer keys are replicated on every rank of the group (one
latent row serves all heads), KDA state is split by heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from .cache import CacheBytes
from .params import ParamCounts, expert_params

WEIGHT_DTYPES = ("bf16", "fp8", "int8")
FP8_SCALE_BYTES = 4 / (128 * 128)   # one fp32 scale per 128x128 block
MEM_FRACTION = 0.88                 # of device memory for weights + cache; the rest is activations/workspace

TP_SPLIT = ("embedding", "head", "kda", "mla", "attn", "indexer", "dense_ffn", "shared_experts")
REPLICATED = ("norms", "mhc", "router")


@dataclass(frozen=True)
class Layout:
    tp: int = 8
    dp: int = 1

    def __post_init__(self):
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"layout needs tp >= 1 and dp >= 1, got tp={self.tp} dp={self.dp}")

    @property
    def devices(self) -> int:
        return self.tp * self.dp


def quantized_components(cfg: ModelConfig) -> tuple[str, ...]:
    """Components stored in fp8/int8 when the weight dtype is quantised (published FP8 checkpoints:
    MLA projections and FFN/experts; glm5_next keeps KDA, indexer and kv_b_proj in bf16)."""
    base = ("mla", "attn", "dense_ffn", "shared_experts", "routed_experts", "mtp")
    return base + (("indexer",) if cfg.arch == "glm_moe_dsa" else ())


def _bytes_per_param(dtype: str, quantized: bool) -> float:
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype {dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    if dtype == "bf16" or not quantized:
        return 2.0
    return 1.0 + (FP8_SCALE_BYTES if dtype == "fp8" else 0.0)


def component_bytes(cfg: ModelConfig, params: ParamCounts, dtype: str) -> dict[str, float]:
    """Bytes of every parameter component at the given weight dtype."""
    quant = quantized_components(cfg)
    out = {k: n * _bytes_per_param(dtype, k in quant) for k, n in params.total_by.items()}
    if dtype != "bf16" and cfg.arch == "glm5_next":   # kv_b_proj stays bf16 in the Flash FP8 release
        kv_b = cfg.kv_lora_rank * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        n_layers = cfg.mixer_types.count("dsa") + cfg.num_mtp_layers
        extra = kv_b * (2.0 - _bytes_per_param(dtype, True))
        out["mla"] += extra * cfg.mixer_types.count("dsa")
        out["mtp"] += extra * (n_layers - cfg.mixer_types.count("dsa"))
    return out


def mtp_routed_params(cfg: ModelConfig) -> int:
    return cfg.num_mtp_layers * cfg.n_routed_experts * expert_params(cfg) if cfg.arch != "llama" else 0


@dataclass(frozen=True)
class DeviceMemory:
    weights: float                 # bytes per device
    usable: float                  # bytes per device for weights + cache
    kv_per_token: float            # bytes per cached token per device (replicated over tp)
    state_per_sequence: float      # bytes per sequence per device
    layout: Layout

    @property
    def fits(self) -> bool:
        return self.weights < self.usable

    @property
    def free(self) -> float:
        return max(self.usable - self.weights, 0.0)

    @property
    def max_tokens(self) -> int:
        """Cached tokens the replica holds (each dp group holds its own)."""
        return int(self.free // self.kv_per_token) * self.layout.dp if self.kv_per_token else 0

    def max_sequences(self, context: int) -> int:
        per_seq = context * self.kv_per_token + self.state_per_sequence
        return int(self.free // per_seq) * self.layout.dp if per_seq else 0


def device_memory(cfg: ModelConfig, params: ParamCounts, cache: CacheBytes, layout: Layout,
                  mem_bytes: float, weight_dtype: str = "fp8", kv_dtype: str = "bf16",
                  with_mtp: bool = True) -> DeviceMemory:
    comp = component_bytes(cfg, params, weight_dtype)
    per_device = sum(comp[k] for k in TP_SPLIT) / layout.tp + sum(comp[k] for k in REPLICATED)
    per_device += comp["routed_experts"] / layout.devices
    if with_mtp and params.total_by["mtp"]:
        routed = mtp_routed_params(cfg) * _bytes_per_param(weight_dtype, True)
        per_device += routed / layout.devices + (comp["mtp"] - routed) / layout.tp
    kv = cache.per_token(kv_dtype) + (cache.mtp_per_token[kv_dtype] if with_mtp else 0.0)
    state = (cache.state_recurrent + cache.state_conv) / layout.tp + cache.state_index_tail
    return DeviceMemory(weights=per_device, usable=mem_bytes * MEM_FRACTION, kv_per_token=kv,
                        state_per_sequence=state, layout=layout)
