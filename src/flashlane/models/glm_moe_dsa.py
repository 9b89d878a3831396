"""GLM-5 / 5.x (``glm_moe_dsa``): pre-norm blocks of MLA+RoPE with DSA, then dense MLP or MoE.

Every layer hands its selection to the next, so runs of ``shared`` indexer layers (F S S S)
reuse the last full layer's choice. The MTP block (``model.layers.{L}``, DeepSeek nextn
layout) is built unless ``with_mtp=False`` (reference state dicts have none).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..trace_ranges import profiling_range
from .dsa_attention import DSAAttention
from .forward_batch import ForwardBatch
from .layers import MoE, RMSNorm, call_layer, dense_or_moe
from .mtp import call_draft, mtp_input


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, ffn: nn.Module | None = None,
                 indexer_type: str | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DSAAttention(cfg, layer_id, indexer_type=indexer_type)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = ffn if ffn is not None else dense_or_moe(cfg, layer_id)
        # a full-indexer layer makes its own selection: it is handed None (one input signature
        # per layer kind for a compiled layer)
        self.takes_selection = self.self_attn.indexer is None

    def forward(self, h: torch.Tensor, batch: ForwardBatch, selection: torch.Tensor | None):
        with profiling_range("norm"):
            x = self.input_layernorm(h, batch.ops)
        with profiling_range("dsa_attention"):
            attn, selection = self.self_attn(x, batch, selection)
            h = h + attn
        with profiling_range("norm"):
            x = self.post_attention_layernorm(h, batch.ops)
        return h + self.mlp(x, batch.ops), selection   # the MLP / MoE opens its own ranges


class MTPLayer(DecoderLayer):
    """DeepSeek nextn block: ``eh_proj([enorm(embed) ; hnorm(hidden)])`` then one DSA+MoE block and
    ``shared_head.norm`` (speculative decoding with method ``mtp`` drafts with it)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id, ffn=MoE(cfg), indexer_type="full")
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps)

    def draft(self, embed_tokens: nn.Module, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        z, _ = super().forward(mtp_input(self, embed_tokens, batch, hidden), batch, None)
        return self.shared_head.norm(z, batch.ops)


class GlmMoeDsaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        if with_mtp:
            layers += [MTPLayer(cfg, cfg.num_layers + j) for j in range(cfg.num_mtp_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.num_trunk_layers = cfg.num_layers

    def forward(self, batch: ForwardBatch, layer_call=call_layer) -> torch.Tensor:
        with profiling_range("embedding"):
            h = self.embed_tokens(batch.input_ids)
        selection = None
        for layer in self.layers[: self.num_trunk_layers]:
            h, selection = layer_call(layer, h, batch, selection if layer.takes_selection else None)
        with profiling_range("norm"):
            return self.norm(h, batch.ops)


class GlmMoeDsaForCausalLM(nn.Module):
    """``forward(batch) -> hidden [N, H]`` (final-normed), ``compute_logits(hidden) -> [M, V]``.

    ``with_mtp`` (default: yes, when the config has MTP layers) builds the MTP block so a
    published checkpoint loads completely; pass False to load a transformers ``save_pretrained``
    state dict strictly (the reference has no MTP weights).
    """

    # the reference keeps these in fp32 whatever the model dtype (loader.cast_model reads this)
    keep_fp32_params = ("e_score_correction_bias", "indexer.weights_proj")

    def __init__(self, cfg: ModelConfig, with_mtp: bool = True):
        super().__init__()
        if cfg.arch != "glm_moe_dsa":
            raise ValueError(f"GlmMoeDsaForCausalLM needs a glm_moe_dsa config, got arch={cfg.arch!r}")
        self.config = cfg
        self.with_mtp = with_mtp and cfg.num_mtp_layers > 0
        self.model = GlmMoeDsaModel(cfg, with_mtp=self.with_mtp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def checkpoint_has_mtp(cfg: ModelConfig, names) -> bool:
        """Whether checkpoint tensor ``names`` carry the MTP block."""
        prefix = f"model.layers.{cfg.num_layers}."
        return cfg.num_mtp_layers > 0 and any(n.startswith(prefix) for n in names)

    def forward(self, batch: ForwardBatch, layer_call=call_layer) -> torch.Tensor:
        """``layer_call``: how each decoder layer is run (see ``layers.call_layer``)."""
        with profiling_range("model_forward"):
            return self.model(batch, layer_call)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with profiling_range("lm_head"):
            return self.lm_head(hidden)

    def mtp(self, batch: ForwardBatch, hidden: torch.Tensor, draft_call=call_draft) -> torch.Tensor:
        """The first MTP layer over ``batch`` (next tokens as input ids) and the previous hidden
        states (``draft_call``: how its ``draft`` is called, see ``models.mtp.call_draft``)."""
        if not self.with_mtp:
            raise RuntimeError("this model was built without its MTP layer (the checkpoint has none)")
        with profiling_range("mtp"):
            return draft_call(self.model.layers[self.config.num_layers], self.model.embed_tokens, batch, hidden)

    def post_load(self) -> None:
        """Nothing derived: the absorbed MLA projections are views of ``kv_b_proj``."""
