"""GLM-5.3-Flash (``glm5_next``) text model over flattened mixed batches.

The residual state is ``hc_mult`` parallel streams per token. Every layer wraps its token mixer
(KDA or DSA) and its FFN (dense clamped-SwiGLU MLP or MoE) in an mHC site: collapse the streams
into the sublayer input, run the sublayer on its RMS-normed input, expand and mix back
(glm5-architecture §1.3). The head is the unweighted stream mean, the final norm and an untied
``lm_head``. A shared-indexer DSA layer reuses the selection of the full DSA layer directly
before it. The module tree gives transformers' ``Glm5NextForConditionalGeneration`` in-memory
names (``model.language_model.*`` + ``lm_head.weight``; no vision tower).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..kernels.backends import KernelBackend, select_backend
from ..trace_ranges import profiling_range
from .dsa_attention import DSAAttention
from .forward_batch import ForwardBatch
from .kda_attention import KDAAttention
from .layers import MoE, RMSNorm, call_layer, dense_or_moe
from .mtp import call_draft, mtp_input


class HyperConnection(nn.Module):
    """One mHC site's parameters: ``fn`` [(2+n)n, n*H], ``base`` [(2+n)n], ``scale`` [3]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n = cfg.hc_mult
        self.fn = nn.Parameter(torch.randn((2 + n) * n, n * cfg.hidden_size) * 0.02)
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))
        self.norm_eps, self.hc_eps, self.iters = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        self.compile_mhc = False   # set_compile: the backend may run the mHC math compiled

    def forward(self, streams: torch.Tensor, ops: KernelBackend | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [N, n, H] -> (sublayer input [N, H], post [N, n], comb [N, n, n])."""
        ops = select_backend(streams.device) if ops is None else ops
        return ops.mhc_pre(streams, self.fn, self.base, self.scale, norm_eps=self.norm_eps,
                           hc_eps=self.hc_eps, sinkhorn_iters=self.iters, compiled=self.compile_mhc)


class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.mixer = cfg.mixer_types[layer_id]
        if self.mixer == "kda":
            self.self_attn = KDAAttention(cfg, layer_id)
        elif self.mixer == "dsa":
            self.self_attn = DSAAttention(cfg, layer_id)
        else:
            raise ValueError(f"layer {layer_id}: glm5_next mixer_types entry {self.mixer!r} is neither 'kda' nor 'dsa'")
        self.mlp = dense_or_moe(cfg, layer_id)
        # only a shared-indexer DSA layer reads the previous selection; the others are handed
        # None, so a compiled layer of one kind sees one input signature
        self.takes_selection = self.mixer == "dsa" and self.self_attn.indexer is None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)
        self.compile_mhc = False   # set_compile: the backend may run the mHC math compiled

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, selection: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [N, n, H]; ``selection`` is the previous full DSA layer's choice (or None).
        Returns the new streams and this layer's selection (None for KDA layers)."""
        ops = batch.ops
        with profiling_range("mhc"):
            u, post, comb = self.attn_hc(streams, ops)
        with profiling_range("norm"):
            h = self.input_layernorm(u, ops)
        if self.mixer == "kda":
            with profiling_range("kda"):
                y, selection = self.self_attn(h, batch), None
        else:
            with profiling_range("dsa_attention"):
                y, selection = self.self_attn(h, batch, selection)
        with profiling_range("mhc"):
            streams = ops.mhc_post(y, streams, post, comb, compiled=self.compile_mhc)
            u, post, comb = self.ffn_hc(streams, ops)
        with profiling_range("norm"):
            h = self.post_attention_layernorm(u, ops)
        y = self.mlp(h, ops)   # the MLP / MoE opens its own ranges
        with profiling_range("mhc"):
            streams = ops.mhc_post(y, streams, post, comb, compiled=self.compile_mhc)
        return streams, selection


class Glm5NextMTPLayer(nn.Module):
    """Next-token-prediction block stored at layer index >= num_layers (spec §1.10): a plain
    pre-norm DSA + MoE block without mHC (speculative decoding with method ``mtp`` drafts with it)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.self_attn = DSAAttention(cfg, layer_id, indexer_type="full")
        self.mlp = MoE(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps)

    def draft(self, embed_tokens: nn.Module, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        z = mtp_input(self, embed_tokens, batch, hidden)
        with profiling_range("dsa_attention"):
            a, _ = self.self_attn(self.input_layernorm(z, batch.ops), batch, None)
        z = z + a
        z = z + self.mlp(self.post_attention_layernorm(z, batch.ops), batch.ops)
        return self.shared_head.norm(z, batch.ops)


class Glm5NextTextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, with_mtp: bool):
        super().__init__()
        self.hc_mult = cfg.hc_mult
        self.num_trunk_layers = cfg.num_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        layers: list[nn.Module] = [Glm5NextDecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        if with_mtp:
            layers += [Glm5NextMTPLayer(cfg, cfg.num_layers + j) for j in range(cfg.num_mtp_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, batch: ForwardBatch, layer_call=call_layer) -> torch.Tensor:
        with profiling_range("embedding"):
            e = self.embed_tokens(batch.input_ids)
        streams = e.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        selection = None
        for layer in self.layers[: self.num_trunk_layers]:
            streams, selection = layer_call(layer, streams, batch, selection if layer.takes_selection else None)
        with profiling_range("mhc"):
            h = streams.mean(1)
        with profiling_range("norm"):
            return self.norm(h, batch.ops)


class Glm5NextModel(nn.Module):
    """Holds the text tower under the name ``language_model`` (the vision tower is not built)."""

    def __init__(self, cfg: ModelConfig, with_mtp: bool):
        super().__init__()
        self.language_model = Glm5NextTextModel(cfg, with_mtp)


class Glm5NextForCausalLM(nn.Module):
    """``forward(batch) -> hidden [N, H]`` (final-normed), ``compute_logits(hidden) -> [M, V]``.

    ``with_mtp`` (default: yes, when the config has MTP layers) builds the MTP block's weights
    so a published checkpoint loads completely; pass False to load a transformers
    ``save_pretrained`` state dict strictly (the reference has no MTP weights).
    """

    # the reference keeps these in fp32 whatever the model dtype (loader.cast_model reads this)
    keep_fp32_params = ("e_score_correction_bias", "A_log", "dt_bias", "conv1d.", "attn_hc.", "ffn_hc.",
                        "index_kpool_compress_ape")

    def __init__(self, cfg: ModelConfig, with_mtp: bool = True):
        super().__init__()
        if cfg.arch != "glm5_next":
            raise ValueError(f"Glm5NextForCausalLM needs a glm5_next config, got arch={cfg.arch!r}")
        self.config = cfg
        self.with_mtp = with_mtp and cfg.num_mtp_layers > 0
        self.model = Glm5NextModel(cfg, self.with_mtp)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:  # the released model is untied; honour a config that says otherwise
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    @staticmethod
    def checkpoint_has_mtp(cfg: ModelConfig, names) -> bool:
        """Whether checkpoint tensor ``names`` carry the MTP block (then build with ``with_mtp``)."""
        prefixes = (f"model.language_model.layers.{cfg.num_layers}.", f"model.layers.{cfg.num_layers}.")
        return cfg.num_mtp_layers > 0 and any(n.startswith(prefixes) for n in names)

    def forward(self, batch: ForwardBatch, layer_call=call_layer) -> torch.Tensor:
        """``layer_call``: how each decoder layer is run (see ``layers.call_layer``)."""
        with profiling_range("model_forward"):
            return self.model.language_model(batch, layer_call)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with profiling_range("lm_head"):
            return self.lm_head(hidden)

    def mtp(self, batch: ForwardBatch, hidden: torch.Tensor, draft_call=call_draft) -> torch.Tensor:
        """The first MTP layer over ``batch`` (next tokens as input ids) and the previous hidden
        states (``draft_call``: how its ``draft`` is called, see ``models.mtp.call_draft``)."""
        if not self.with_mtp:
            raise RuntimeError("this model was built without its MTP layer (the checkpoint has none)")
        text = self.model.language_model
        with profiling_range("mtp"):
            return draft_call(text.layers[self.config.num_layers], text.embed_tokens, batch, hidden)

    def post_load(self) -> None:
        """Nothing derived: the absorbed MLA projections are views of ``kv_b_proj``."""

    def set_compile(self, on: bool) -> None:
        """Ask the kernel backend to run the mHC pre/post math compiled (the cpu backend:
        torch.compile, see kernels/compiled.py) or eagerly."""
        for m in self.modules():
            if isinstance(m, (HyperConnection, Glm5NextDecoderLayer)):
                m.compile_mhc = on


__all__ = ["Glm5NextForCausalLM", "Glm5NextDecoderLayer", "Glm5NextMTPLayer", "HyperConnection"]
