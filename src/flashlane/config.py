"""Model configuration: one parser from a Hugging Face ``config.json`` to a frozen dataclass.

Torch-free on purpose: the engine, the models and ``analyze`` all read configs through this
module, so the layer plan (which layers are KDA / DSA, which indexers are full or shared, which
FFNs are dense or MoE) is derived in exactly one place.

Layer kinds used everywhere in flashlane:
  mixer:   "kda" (Kimi-Delta linear attention), "dsa" (MLA + sparse indexer), "attn" (llama GQA)
  ffn:     "dense" or "moe"
  indexer: "full", "shared" (reuse the previous full layer's selection) or "none"
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ARCHITECTURES = ("glm5_next", "glm_moe_dsa", "llama")


class ConfigError(ValueError):
    """A config that flashlane cannot run; the message names the offending field."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    mixer_types: tuple[str, ...]
    ffn_types: tuple[str, ...]
    indexer_types: tuple[str, ...]
    intermediate_size: int
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # attention (llama GQA and MLA share num_heads)
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    # MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mla_norm_eps: float = 1e-6
    # DSA indexer
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_kpool: int = 1
    index_always_select_tail: bool = False
    # KDA
    linear_num_heads: int = 0
    linear_head_dim: int = 0
    conv_kernel: int = 0
    linear_lower_bound: float | None = None
    # mHC
    hc_mult: int = 1
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # FFN / MoE
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    swiglu_limit: float | None = None
    num_mtp_layers: int = 0
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived views -------------------------------------------------------------------
    def layers_of(self, mixer: str) -> list[int]:
        return [i for i, t in enumerate(self.mixer_types) if t == mixer]

    @property
    def full_indexer_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.indexer_types[i] == "full"]

    @property
    def kda_qkv_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def mla_cache_dim(self) -> int:
        """Values cached per token per MLA layer: the normed latent plus the roped shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "raw"}


# ---- parsing -------------------------------------------------------------------------------

def load_config(path: str | Path) -> ModelConfig:
    """Parse a ``config.json`` file, or a checkpoint folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    return parse_config(data)


def parse_config(data: dict[str, Any]) -> ModelConfig:
    if not isinstance(data, dict):
        raise ConfigError("config must be a JSON object")
    model_type = data.get("model_type")
    if model_type in ("glm5_next", "glm5_next_text"):
        text = data.get("text_config") or data
        if not isinstance(text, dict):
            raise ConfigError("glm5_next config: text_config must be an object")
        merged = {**text}
        for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"):
            if key not in merged and key in data:
                merged[key] = data[key]
        return _parse_glm5_next(merged, raw=data)
    if model_type == "glm_moe_dsa":
        return _parse_glm_moe_dsa(data)
    if model_type in ("llama", "mistral", "qwen2") or (
        model_type is None and "LlamaForCausalLM" in (data.get("architectures") or [])
    ):
        return _parse_llama(data)
    raise ConfigError(
        f"unsupported architecture: model_type={model_type!r} (supported: {', '.join(ARCHITECTURES)})"
    )


def _req(d: dict, key: str, kind: type = int):
    if key not in d or d[key] is None:
        raise ConfigError(f"config field {key!r} is missing")
    value = d[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"config field {key!r} must be an integer, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise ConfigError(f"config field {key!r} must be a number, got {value!r}")
    if kind is int and value <= 0:
        raise ConfigError(f"config field {key!r} must be positive, got {value}")
    return value


def _eos(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _indexer_plan(d: dict, n: int, default_offset: int) -> list[str]:
    if d.get("indexer_types") is not None:
        plan = list(d["indexer_types"])
    elif d.get("index_topk_pattern") is not None:
        pattern = d["index_topk_pattern"]
        try:
            plan = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        except KeyError as exc:
            raise ConfigError(f"index_topk_pattern has an unknown letter {exc}; use F and S") from exc
    else:
        freq = max(int(d.get("index_topk_freq", 1)), 1)
        offset = int(d.get("index_skip_topk_offset", default_offset))
        plan = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(plan) != n:
        raise ConfigError(f"indexer_types has {len(plan)} entries for {n} layers")
    for t in plan:
        if t not in ("full", "shared"):
            raise ConfigError(f"indexer_types entry {t!r} is neither 'full' nor 'shared'")
    return plan


def _ffn_plan(d: dict, n: int, first_dense: int) -> list[str]:
    plan = d.get("mlp_layer_types")
    if plan is None:
        k = min(first_dense, n)
        return ["dense"] * k + ["moe"] * (n - k)
    if len(plan) != n:
        raise ConfigError(f"mlp_layer_types has {len(plan)} entries for {n} layers")
    out = []
    for t in plan:
        if t not in ("dense", "sparse"):
            raise ConfigError(f"mlp_layer_types entry {t!r} is neither 'dense' nor 'sparse'")
        out.append("dense" if t == "dense" else "moe")
    return out


def _moe_fields(d: dict) -> dict[str, Any]:
    return dict(
        moe_intermediate_size=_req(d, "moe_intermediate_size"),
        n_routed_experts=_req(d, "n_routed_experts"),
        n_shared_experts=int(d.get("n_shared_experts", 1) or 0),
        num_experts_per_tok=_req(d, "num_experts_per_tok"),
        n_group=int(d.get("n_group", 1) or 1),
        topk_group=int(d.get("topk_group", 1) or 1),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
    )


def _mla_fields(d: dict) -> dict[str, Any]:
    heads = _req(d, "num_attention_heads")
    kv_heads = d.get("num_key_value_heads", heads)
    if kv_heads != heads:
        raise ConfigError(f"MLA needs num_key_value_heads == num_attention_heads, got {kv_heads} vs {heads}")
    return dict(
        num_heads=heads,
        num_kv_heads=heads,
        q_lora_rank=_req(d, "q_lora_rank"),
        kv_lora_rank=_req(d, "kv_lora_rank"),
        qk_nope_head_dim=_req(d, "qk_nope_head_dim"),
        qk_rope_head_dim=int(d.get("qk_rope_head_dim", 0) or 0),
        v_head_dim=_req(d, "v_head_dim"),
        index_n_heads=_req(d, "index_n_heads"),
        index_head_dim=_req(d, "index_head_dim"),
        index_topk=_req(d, "index_topk"),
    )


def _common(d: dict) -> dict[str, Any]:
    return dict(
        vocab_size=_req(d, "vocab_size"),
        hidden_size=_req(d, "hidden_size"),
        num_layers=_req(d, "num_hidden_layers"),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        intermediate_size=_req(d, "intermediate_size"),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
    )


def _parse_glm5_next(d: dict, raw: dict) -> ModelConfig:
    n = _req(d, "num_hidden_layers")
    lin = d.get("linear_attn_config") or {}
    mixer_raw = d.get("layer_types") or [
        "linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)
    ]
    if len(mixer_raw) != n:
        raise ConfigError(f"layer_types has {len(mixer_raw)} entries for {n} layers")
    mixers = []
    for t in mixer_raw:
        if t == "linear_attention":
            mixers.append("kda")
        elif t in ("indexed_attention", "full_attention", "deepseek_sparse_attention"):
            mixers.append("dsa")
        else:
            raise ConfigError(f"layer_types entry {t!r} is not a glm5_next layer type")
    indexers = _indexer_plan(d, n, default_offset=2)
    for i in range(n):
        if mixers[i] != "dsa":
            indexers[i] = "none"
        elif indexers[i] == "shared" and (i == 0 or mixers[i - 1] != "dsa" or indexers[i - 1] != "full"):
            # the reference hands indices only from a full DSA layer to the very next layer
            raise ConfigError(f"layer {i}: a shared indexer must directly follow a full DSA layer")
    mla = _mla_fields(d)
    if mla["qk_rope_head_dim"] != 0:
        raise ConfigError("glm5_next DSA layers are NoPE: qk_rope_head_dim must be 0")
    kpool = int(d.get("index_kpool", 16))
    if kpool < 1 or mla["index_topk"] % kpool:
        raise ConfigError(f"index_topk ({mla['index_topk']}) must be a positive multiple of index_kpool ({kpool})")
    lower = lin.get("gate_lower_bound", d.get("linear_lower_bound", -5.0))
    return ModelConfig(
        arch="glm5_next",
        **_common(d),
        mixer_types=tuple(mixers),
        ffn_types=tuple(_ffn_plan(d, n, 3)),
        indexer_types=tuple(indexers),
        **mla,
        mla_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        index_kpool=kpool,
        index_always_select_tail=bool(d.get("index_kpool_always_select_tail", True)),
        linear_num_heads=int(lin.get("num_heads", d.get("linear_num_heads", 64))),
        linear_head_dim=int(lin.get("head_dim", d.get("linear_head_dim", 128))),
        conv_kernel=int(lin.get("short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4))),
        linear_lower_bound=None if lower is None else float(lower),
        hc_mult=int(d.get("hc_mult", 4)),
        hc_eps=float(d.get("hc_eps", 1e-6)),
        hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)),
        **_moe_fields(d),
        swiglu_limit=d.get("swiglu_limit", 10.0),
        num_mtp_layers=int(d.get("num_nextn_predict_layers", 1)),
        raw=raw,
    )


def _rope(d: dict) -> tuple[float, dict | None]:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = None if rope_type in (None, "default") else dict(params)
    return float(theta), scaling


def _parse_glm_moe_dsa(d: dict) -> ModelConfig:
    n = _req(d, "num_hidden_layers")
    theta, scaling = _rope(d)
    if scaling is not None:
        raise ConfigError(f"glm_moe_dsa rope type {scaling.get('rope_type')!r} is not supported (only 'default')")
    mla = _mla_fields(d)
    if mla["qk_rope_head_dim"] <= 0:
        raise ConfigError("glm_moe_dsa needs qk_rope_head_dim > 0")
    indexers = _indexer_plan(d, n, default_offset=2)
    if indexers[0] != "full":
        raise ConfigError("layer 0: the first DSA layer must have a full indexer (nothing to share from)")
    return ModelConfig(
        arch="glm_moe_dsa",
        **_common(d),
        mixer_types=("dsa",) * n,
        ffn_types=tuple(_ffn_plan(d, n, int(d.get("first_k_dense_replace", 3)))),
        indexer_types=tuple(indexers),
        **mla,
        mla_norm_eps=1e-6,  # HF builds q_a / kv_a norms without rms_norm_eps (spec §2)
        rope_theta=theta,
        index_kpool=1,
        **_moe_fields(d),
        swiglu_limit=None,
        num_mtp_layers=int(d.get("num_nextn_predict_layers", 1)),
        raw=d,
    )


def _parse_llama(d: dict) -> ModelConfig:
    n = _req(d, "num_hidden_layers")
    heads = _req(d, "num_attention_heads")
    kv_heads = int(d.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    hidden = _req(d, "hidden_size")
    theta, scaling = _rope(d)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("llama3",):
        raise ConfigError(f"llama rope type {scaling.get('rope_type')!r} is not supported")
    return ModelConfig(
        arch="llama",
        **_common(d),
        mixer_types=("attn",) * n,
        ffn_types=("dense",) * n,
        indexer_types=("none",) * n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(d.get("head_dim") or hidden // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        raw=d,
    )
