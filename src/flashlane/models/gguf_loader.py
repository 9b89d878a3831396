"""llama-architecture GGUF files (llama.cpp): metadata -> HF config dict, tensors -> HF names, tokenizer.

Quantised tensors (Q4_0/Q4_1/Q8_0/K-quants, whatever ``gguf.quants`` can dequantise) become
float32. llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` from the
rotate-half layout into interleaved pairs; ``unpermute_qk`` undoes that so the tensors fit the
transformers llama layout flashlane uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from .loader import LoadError
from .tokenizer import Tokenizer, TokenizerError


class GGUFError(LoadError):
    """A GGUF file flashlane cannot use; the message names the key or tensor."""


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# pre-tokenizers whose digit handling differs from plain GPT-2 byte-level splitting
_SPLIT_DIGITS = {"smollm", "starcoder", "refact", "qwen2", "deepseek-llm"}


def open_gguf(path: str | Path):
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist")
    try:
        return GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError / struct errors on bad files
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from exc


def field(reader, key: str, default: Any = KeyError) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise GGUFError(f"GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def gguf_config(reader) -> dict[str, Any]:
    """An HF ``config.json``-style dict for a llama-architecture GGUF."""
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF general.architecture={arch!r} is not supported (only 'llama')")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError("GGUF tensor rope_freqs.weight (llama3 rope scaling) is not supported")
    heads = int(field(reader, "llama.attention.head_count"))
    hidden = int(field(reader, "llama.embedding_length"))
    tokens = field(reader, "tokenizer.ggml.tokens", None)
    vocab = field(reader, "llama.vocab_size", None) or (len(tokens) if tokens is not None else None)
    if vocab is None:
        raise GGUFError("GGUF has neither llama.vocab_size nor tokenizer.ggml.tokens")
    head_dim = field(reader, "llama.attention.key_length", None) or hidden // heads
    cfg = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(field(reader, "llama.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": field(reader, "tokenizer.ggml.padding_token_id", None),
    }
    scaling = field(reader, "llama.rope.scaling.type", None)
    if scaling not in (None, "none"):
        raise GGUFError(f"GGUF llama.rope.scaling.type={scaling!r} is not supported")
    return cfg


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's row permutation: per head, rows (pair i, member j) -> (j, i)."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"cannot un-permute a q/k tensor of {rows} rows over {n_heads} heads")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str:
    """The transformers llama name of a GGUF tensor."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
        raise GGUFError(f"GGUF tensor {gguf_name} has no llama counterpart")
    return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"


def _unpermuted(gguf_name: str, rows: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """``rows`` (one per output row: values or raw blocks) in the transformers order."""
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
        return unpermute_qk(rows, cfg["num_attention_heads"])
    if gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
        return unpermute_qk(rows, cfg["num_key_value_heads"])
    return rows


def gguf_tensors(reader, cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """All tensors, dequantised to float32, under transformers llama names."""
    from gguf import quants

    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        try:
            data = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise GGUFError(f"GGUF tensor {t.name}: type {t.tensor_type.name} cannot be dequantised") from exc
        out[name] = _unpermuted(t.name, torch.from_numpy(np.array(data, dtype=np.float32, copy=True)), cfg)
    return out


# GGUF block types flashlane multiplies as they are stored (kernels.gguf_blocks)
BLOCK_KINDS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}


def gguf_blocks(reader, cfg: dict[str, Any]) -> dict[str, tuple[str, torch.Tensor]]:
    """The 2-D tensors stored in a ``BLOCK_KINDS`` type, under transformers llama names: (block
    kind, the file's bytes as uint8 [rows, bytes per row], rows in the transformers order)."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for t in reader.tensors:
        kind = BLOCK_KINDS.get(t.tensor_type.name)
        if kind is None or len(t.shape) != 2:
            continue
        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True))
        out[hf_name(t.name)] = (kind, _unpermuted(t.name, raw, cfg).contiguous())
    return out


def tokenizer_from_gguf(reader) -> Tokenizer:
    """A byte-level BPE ``tokenizers`` tokenizer from ``tokenizer.ggml.*`` (GPT-2 style vocabularies)."""
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    model = field(reader, "tokenizer.ggml.model", None)
    if model != "gpt2":
        raise TokenizerError(f"GGUF tokenizer.ggml.model={model!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = field(reader, "tokenizer.ggml.merges")
    types = field(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre in _SPLIT_DIGITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # 3 = control, 4 = user-defined: never split by BPE; control tokens are "special" (skippable)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    bos_id = field(reader, "tokenizer.ggml.bos_token_id", None)
    bos = tokens[bos_id] if bos_id is not None and 0 <= bos_id < len(tokens) else None
    if bos is not None and field(reader, "tokenizer.ggml.add_bos_token", False):
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
    eos = [field(reader, k, None) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return Tokenizer(tok, bos_token=bos, eos_token_ids=[e for e in eos if e is not None],
                     chat_template=field(reader, "tokenizer.chat_template", None))
