"""A tiny llama written as GGUF (F32 / F16 / Q8_0 / Q4_1, llama.cpp q/k row order) loads back exactly."""

import gguf
import numpy as np
import pytest
import torch

from flashlane import presets
from flashlane.cli.make_tiny import tiny_llama_config
from flashlane.config import parse_config
from flashlane.models.gguf_loader import GGUFError, unpermute_qk
from flashlane.models.loader import random_state
from flashlane.models.registry import build_model, load_model

Q = gguf.GGMLQuantizationType
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
QTYPE = {"attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q4_1, "ffn_up.weight": Q.Q4_1, "attn_v.weight": Q.F16}


def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (written from its description, for the test)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def test_unpermute_inverts_the_llama_cpp_permutation():
    w = torch.arange(6 * 8 * 3, dtype=torch.float32).reshape(48, 3)
    assert torch.equal(unpermute_qk(llama_cpp_permute(w, 6), 6), w)
    assert not torch.equal(llama_cpp_permute(w, 6), w)
    with pytest.raises(GGUFError, match="cannot un-permute"):
        unpermute_qk(torch.zeros(10, 3), 3)


def _write_gguf(path, arch="llama", untied=False):
    cfg_dict = {**tiny_llama_config(), "tie_word_embeddings": not untied}
    cfg = parse_config(cfg_dict)
    state = random_state(build_model(cfg), seed=4)
    tok = presets.build_tiny_tokenizer()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in presets.SPECIAL_TOKENS else 1 for t in tokens])
    merges = json_merges(tok)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(presets.TINY_CHAT_TEMPLATE)
    expected = {}
    for name, t in state.items():
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers."):].split(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[rest]}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        data = t.float()
        if gname.endswith("attn_q.weight"):
            data = llama_cpp_permute(data, cfg.num_heads)
        elif gname.endswith("attn_k.weight"):
            data = llama_cpp_permute(data, cfg.num_kv_heads)
        qtype = QTYPE.get(gname.split(".", 2)[-1], Q.F32)
        arr = data.numpy()
        if qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
            back = torch.from_numpy(arr.astype(np.float16).astype(np.float32))
        elif qtype == Q.F32:
            w.add_tensor(gname, arr)
            back = data
        else:
            packed = gguf.quants.quantize(arr, qtype)
            w.add_tensor(gname, packed, raw_shape=packed.shape, raw_dtype=qtype)
            back = torch.from_numpy(gguf.quants.dequantize(packed, qtype).copy())
        if gname.endswith("attn_q.weight"):
            back = unpermute_qk(back, cfg.num_heads)
        elif gname.endswith("attn_k.weight"):
            back = unpermute_qk(back, cfg.num_kv_heads)
        expected[name] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state, expected


def json_merges(tok):
    import json

    merges = json.loads(tok.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_tiny_gguf_round_trip(tmp_path, untied):
    path = tmp_path / "tiny.gguf"
    original, expected = _write_gguf(path, untied=untied)
    loaded = load_model(path)
    assert loaded.name == "tiny" and loaded.config.tie_word_embeddings == (not untied)
    ours = loaded.model.state_dict()
    for name, t in expected.items():
        assert torch.equal(ours[name], t), name
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (ours[q] - original[q]).abs().max() < 0.01  # Q8_0 error, and the rows are back in place
    tok = loaded.tokenizer
    ref = presets.build_tiny_tokenizer()
    text = "The scheduler admits 1536 tokens, then stops. <|user|>"
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text).ids
    assert tok.encode(text)[0] == 1  # add_bos_token
    assert tok.eos_token_ids == (0,)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]).startswith("[gMASK]<sop><|user|>")


def test_tiny_gguf_matches_transformers_gguf_loader(tmp_path):
    import transformers
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, untied=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    ours = load_model(path).model.state_dict()
    ref = hf.state_dict()
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name], t), name


def test_gguf_errors(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="general.architecture='gpt2' is not supported"):
        load_model(path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="bad.gguf is not a readable GGUF file"):
        load_model(bad)
