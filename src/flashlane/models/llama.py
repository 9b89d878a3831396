"""Llama-family decoder (SmolLM2 and friends) over flattened mixed batches and a paged KV pool.

GQA attention with rotate-half RoPE; each layer hands q, k, v and its latent-pool row to the
kernel backend (``batch.ops.dense_attention``), which stores ``[K | V]`` of every new token at
``batch.slot_mapping`` and attends over the sequence history read through ``batch.block_tables``,
with one attention plan per forward shared by all layers. Parameter names follow the
transformers in-memory state_dict.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.backends.base import DenseDecoderLayer
from ..trace_ranges import profiling_range
from .forward_batch import ForwardBatch
from .layers import MLP, RMSNorm, call_layer


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv
    # llama3: long wavelengths slowed by `factor`, a smooth ramp between the two cut-offs
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s.get("original_max_position_embeddings", cfg.max_position_embeddings))
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    ramp = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, ramp, scaled)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = bool(cfg.raw.get("attention_bias", False))
        qkv_bias = bias or cfg.raw.get("model_type") == "qwen2"  # qwen2: q/k/v biases, none on o
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)

    def pool(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This layer's rows of the latent pool and their scales (None unless int8)."""
        row = batch.cache.spec.latent_row(self.layer_id)
        return batch.cache.layer("latent", row), batch.cache.layer("latent_scale", row)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch, plan: Any,
                pool: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """``pool``: ``self.pool(batch)``, looked up once by the decoder layer."""
        n, d = x.shape[0], self.head_dim
        ops = batch.ops
        q = ops.rope_rotate_half(self.q_proj(x).view(n, self.num_heads, d), cos, sin)
        k = ops.rope_rotate_half(self.k_proj(x).view(n, self.num_kv, d), cos, sin)
        v = self.v_proj(x).view(n, self.num_kv, d)
        out = ops.dense_attention(q, k, v, *pool, batch, plan)
        return self.o_proj(out.reshape(n, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def parts(self) -> DenseDecoderLayer:
        # read through the module dicts: nn.Module attribute lookups cost ~1 us each, per layer and step
        mods = self._modules
        attn, ln1, ln2 = mods["self_attn"], mods["input_layernorm"], mods["post_attention_layernorm"]
        a, m = attn._modules, mods["mlp"]._modules
        return DenseDecoderLayer(ln1._parameters["weight"], ln2._parameters["weight"], ln1.eps, a["q_proj"],
                                 a["k_proj"], a["v_proj"], a["o_proj"], m["gate_proj"], m["up_proj"],
                                 m["down_proj"], attn.num_heads, attn.num_kv, attn.head_dim)

    def forward(self, h, batch, cos, sin, plan):
        pool = self.self_attn.pool(batch)
        with profiling_range("decoder_layer"):
            out = batch.ops.dense_decoder_layer(self.parts(), h, cos, sin, *pool, batch, plan)
        if out is not None:
            return out
        with profiling_range("norm"):
            x = self.input_layernorm(h, batch.ops)
        with profiling_range("attention"):
            h = h + self.self_attn(x, cos, sin, batch, plan, pool)
        with profiling_range("norm"):
            x = self.post_attention_layernorm(h, batch.ops)
        return h + self.mlp(x, batch.ops)   # the MLP opens its own range


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, batch: ForwardBatch, layer_call=call_layer) -> torch.Tensor:
        with profiling_range("embedding"):
            h = self.embed_tokens(batch.input_ids)
        with profiling_range("attention"):   # RoPE tables and gather plan, shared by all layers
            freqs = batch.positions[:, None].float() * self.inv_freq.float()[None, :]
            emb = torch.cat((freqs, freqs), -1)
            cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
            plan = batch.ops.plan_attention(batch)
        for layer in self.layers:
            h = layer_call(layer, h, batch, cos, sin, plan)
        with profiling_range("norm"):
            return self.norm(h, batch.ops)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.arch != "llama":
            raise ValueError(f"LlamaForCausalLM needs a llama config, got arch={cfg.arch!r}")
        raw = cfg.raw
        if raw.get("mlp_bias"):
            raise ValueError("llama config field 'mlp_bias' = true is not supported")
        if raw.get("sliding_window") is not None and raw.get("use_sliding_window", raw.get("model_type") == "mistral"):
            raise ValueError("llama-family config field 'sliding_window' is not supported (full attention only)")
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch, layer_call=call_layer) -> torch.Tensor:
        """``layer_call``: how each decoder layer is run (see ``layers.call_layer``)."""
        with profiling_range("model_forward"):
            return self.model(batch, layer_call)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with profiling_range("lm_head"):
            return self.lm_head(hidden)

    def post_load(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
