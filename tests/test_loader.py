"""Checkpoint folders: transformers round trips, shards, published names, FP8, random init, errors."""

import json
import shutil

import pytest
import torch
import transformers
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file

from flashlane.cli.make_tiny import make_tiny, tiny_config, tiny_llama_config
from flashlane.config import ConfigError, parse_config
from flashlane.models import registry
from flashlane.models.loader import (
    FP32_PARAMS,
    LoadError,
    load_state,
    random_state,
    random_tensor,
    resolve_dtype,
)
from flashlane.models.registry import load_model
from flashlane.models.weights import (
    dequantize_fp8_blocks,
    quantize_fp8_blocks,
    to_flashlane,
    to_published,
)

ARCHS = ["llama", "glm_moe_dsa", "glm5_next"]


def _logprobs(loaded, prompts, chunk=None):
    runner = PagedRunner(loaded.model, loaded.config, page_size=16, max_tokens=128, max_seqs=len(prompts))
    return runner.prefill(prompts, chunk)


def _prompts(vocab, lengths=(9, 30), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(7, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_llama(tie, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
                                   max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


# ---- transformers save_pretrained folders ---------------------------------------------------

@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("shard", [None, "40KB"], ids=["single", "sharded"])
def test_llama_save_pretrained_round_trip(tmp_path, tie, shard):
    hf = _hf_llama(tie)
    kwargs = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    loaded = load_model(tmp_path, require_tokenizer=False)
    assert loaded.name == tmp_path.name and loaded.tokenizer is None
    prompts = _prompts(200)
    for p, lp in zip(prompts, _logprobs(loaded, prompts, chunk=8)):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p])).logits[0], -1)
        assert (lp - ref).abs().max().item() <= 1e-4


def _hf_glm(arch):
    import hf_tiny

    if arch == "glm5_next":
        model = hf_tiny.make_hf_glm5_next(seed=1)
        return model, hf_tiny.glm5_next_text_state_dict(model)
    model = hf_tiny.make_hf_glm_moe_dsa(seed=1)
    return model, model.state_dict()


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "glm5_next"])
def test_to_published_matches_transformers_saved_layout(tmp_path, arch):
    """transformers writes the published layout on save: our inverse must produce exactly it."""
    hf, in_memory = _hf_glm(arch)
    hf.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    saved = {k: v for k, v in saved.items() if not k.startswith("model.visual.")}
    cfg = parse_config(hf.config.to_dict())
    published = to_published(in_memory, cfg)
    assert set(published) == set(saved)
    for name, t in saved.items():
        assert torch.equal(published[name], t), name
    back = to_flashlane(saved, cfg)
    assert set(back) == set(in_memory)
    for name, t in in_memory.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "glm5_next"])
def test_glm_save_pretrained_folder_loads_exactly(tmp_path, arch):
    hf, in_memory = _hf_glm(arch)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, require_tokenizer=False)
    ours = loaded.model.state_dict()
    assert set(ours) == set(in_memory)   # flashlane names == transformers in-memory names
    for name, t in in_memory.items():
        assert torch.equal(ours[name], t), name


# ---- random checkpoints: published vs in-memory names, shards -------------------------------

def _small_config(arch):
    """Reference-test sized configs (the presets are larger than these tests need)."""
    import hf_tiny

    if arch == "llama":
        return tiny_llama_config()
    if arch == "glm5_next":
        return hf_tiny.glm5_next_hf_config().to_dict()
    return hf_tiny.glm_moe_dsa_hf_config().to_dict()


def _write(folder, arch, seed, published=False, shards=1):
    registry.write_random_checkpoint(folder, _small_config(arch), seed=seed, published_names=published,
                                     num_shards=shards)
    return folder


@pytest.mark.parametrize("arch", ARCHS)
def test_published_names_give_the_same_model(tmp_path, arch):
    a = _write(tmp_path / "memory", arch, seed=3)
    b = _write(tmp_path / "published", arch, seed=3, published=True)
    names_b = set(load_file(b / "model.safetensors"))
    if arch == "glm5_next":
        assert any(".hc_attn_fn" in n for n in names_b) and any(".q_conv1d." in n for n in names_b)
    if arch != "llama":
        assert any(".mlp.experts.0.gate_proj.weight" in n for n in names_b)
    la, lb = load_model(a, require_tokenizer=False), load_model(b, require_tokenizer=False)
    sa, sb = la.model.state_dict(), lb.model.state_dict()
    assert set(sa) == set(sb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    prompts = _prompts(la.config.vocab_size, lengths=(12,))
    assert torch.equal(_logprobs(la, prompts)[0], _logprobs(lb, prompts)[0])


def test_make_tiny_cli_writes_loadable_sharded_folders(tmp_path):
    from flashlane.cli import make_tiny as cli

    parser = __import__("argparse").ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["make-tiny", "--arch", "llama", "--out", str(tmp_path / "cli"), "--seed", "5"])
    assert cli.run(args) == 0
    assert cli.run(args) == 2  # refuses to overwrite a non-empty folder
    loaded = load_model(tmp_path / "cli")
    assert loaded.tokenizer is not None and loaded.config.arch == "llama"


def test_sharded_make_tiny_equals_single_file(tmp_path):
    single = load_model(make_tiny("llama", tmp_path / "one", seed=5))
    folder = make_tiny("llama", tmp_path / "three", seed=5, num_shards=3)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    sharded = load_model(folder)
    s1, s3 = single.model.state_dict(), sharded.model.state_dict()
    assert all(torch.equal(s1[k], s3[k]) for k in s1)


# ---- FP8 block-scaled weights ---------------------------------------------------------------

def test_dequantize_fp8_blocks_matches_blockwise_loop():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(200, 300, generator=g) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) + 0.5
    got = dequantize_fp8_blocks(w, s)
    want = torch.empty(200, 300)
    for i in range(2):
        for j in range(3):
            want[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (
                w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float() * s[i, j])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"scale_inv has shape \(3, 3\), expected \(2, 3\)"):
        dequantize_fp8_blocks(w, torch.ones(3, 3), "x.weight")


@pytest.mark.parametrize("arch", ["llama", "glm_moe_dsa"])
def test_fp8_checkpoint_is_dequantised_on_load(tmp_path, arch):
    folder = _write(tmp_path / "fp8", arch, seed=2, published=True)
    tensors = load_file(folder / "model.safetensors")
    quantised, expected = {}, {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith("proj.weight"):
            q, s = quantize_fp8_blocks(t.float())
            quantised[name], quantised[name + "_scale_inv"] = q, s
            expected[name] = dequantize_fp8_blocks(q, s)
            assert (expected[name] - t.float()).abs().max() <= 0.07 * t.float().abs().max()
        else:
            quantised[name] = t
    save_file(quantised, str(folder / "model.safetensors"))
    loaded = load_model(folder, require_tokenizer=False)
    cfg = loaded.config
    want = to_flashlane({**tensors, **expected}, cfg)
    ours = loaded.model.state_dict()
    for name, t in want.items():
        assert torch.equal(ours[name], t.float()), name


# ---- random init ----------------------------------------------------------------------------

def test_random_init_is_a_function_of_seed_and_name(tmp_path):
    folder = make_tiny("llama", tmp_path / "m", seed=0)
    a = load_model(folder, load_format="dummy", seed=7).model.state_dict()
    b = load_model(folder, load_format="dummy", seed=7).model.state_dict()
    c = load_model(folder, load_format="dummy", seed=8).model.state_dict()
    name = "model.layers.1.self_attn.q_proj.weight"
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[name], c[name])
    assert torch.equal(a[name], random_tensor(name, tuple(a[name].shape), 7))
    assert not torch.equal(a[name], a["model.layers.0.self_attn.q_proj.weight"])
    assert 0.015 < a[name].std().item() < 0.025
    assert torch.equal(a["model.norm.weight"], torch.ones_like(a["model.norm.weight"]))


def test_random_values_are_sensible_for_special_tensors():
    a_log = random_tensor("x.self_attn.forget_gate.A_log", (64,), 0)
    assert a_log.min() >= 0 and a_log.max() <= torch.log(torch.tensor(16.0))
    dt = torch.nn.functional.softplus(random_tensor("x.forget_gate.dt_bias", (256,), 0))
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    assert torch.equal(random_tensor("x.mlp.gate.e_score_correction_bias", (8,), 0), torch.zeros(8))
    assert torch.equal(random_tensor("x.attn_hc.base", (24,), 0), torch.zeros(24))
    assert torch.equal(random_tensor("x.attn_hc.scale", (3,), 0), torch.ones(3))
    conv = random_tensor("x.self_attn.conv1d.weight", (12, 1, 4), 0)
    assert conv.abs().max() <= 0.5 and conv.std() > 0.1


def test_random_state_skips_tied_duplicates():
    cfg = parse_config(tiny_llama_config())
    model = registry.build_model(cfg)
    state = random_state(model, 0)
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state


# ---- dtypes ---------------------------------------------------------------------------------

def test_dtype_resolution():
    cfg = parse_config({**tiny_llama_config(), "dtype": "bfloat16"})
    assert resolve_dtype("auto", cfg, "cpu") == torch.float32
    assert resolve_dtype("auto", cfg, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", parse_config({**cfg.raw, "dtype": "float16"}), "cuda") == torch.float16
    assert resolve_dtype("bfloat16", cfg, "cpu") == torch.bfloat16
    with pytest.raises(LoadError, match="dtype 'int4'"):
        resolve_dtype("int4", cfg)


@pytest.mark.parametrize("arch", ["llama", "glm5_next"])
def test_bfloat16_load_keeps_fp32_tensors(tmp_path, arch):
    loaded = load_model(make_tiny(arch, tmp_path / "m", seed=1), dtype="bfloat16")
    keep = getattr(loaded.model, "keep_fp32_params", FP32_PARAMS)
    dtypes = {n: p.dtype for n, p in loaded.model.state_dict().items() if p.is_floating_point()}
    assert dtypes["model.norm.weight" if arch == "llama" else "model.language_model.norm.weight"] == torch.bfloat16
    for name, dt in dtypes.items():
        if any(k in name for k in keep):
            assert dt == torch.float32, name
    state = loaded.model.state_dict()
    low = sum(t.numel() for t in state.values() if t.dtype == torch.bfloat16)
    assert low > 0.9 * sum(t.numel() for t in state.values())
    if arch == "glm5_next":
        assert any(dt == torch.float32 for dt in dtypes.values())
    logits = _logprobs(loaded, _prompts(loaded.config.vocab_size, lengths=(10,)))[0]
    assert torch.isfinite(logits).all()


# ---- errors ---------------------------------------------------------------------------------

@pytest.fixture
def llama_folder(tmp_path):
    return make_tiny("llama", tmp_path / "llama", seed=0)


def test_unknown_model_id_lists_presets():
    with pytest.raises(LoadError, match="unknown model 'no-such-model'.*tiny-flash"):
        load_model("no-such-model")
    with pytest.raises(LoadError, match="does not exist"):
        load_model("/nonexistent/model.gguf")
    with pytest.raises(LoadError, match="load_format 'pt'"):
        load_model("tiny-flash", load_format="pt")


def test_config_errors_name_the_problem(llama_folder):
    (llama_folder / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(llama_folder)
    cfg = tiny_llama_config()
    del cfg["hidden_size"]
    (llama_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        load_model(llama_folder)
    (llama_folder / "config.json").write_text(json.dumps({**cfg, "hidden_size": 128, "model_type": "gpt_neox"}))
    with pytest.raises(ConfigError, match="unsupported architecture: model_type='gpt_neox'"):
        load_model(llama_folder)
    (llama_folder / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(llama_folder)


def test_missing_unexpected_and_misshapen_tensors(llama_folder):
    path = llama_folder / "model.safetensors"
    good = load_file(path)
    name = "model.layers.2.mlp.up_proj.weight"
    save_file({k: v for k, v in good.items() if k != name}, str(path))
    with pytest.raises(LoadError, match=f"lacks tensor.*{name}"):
        load_model(llama_folder)
    save_file({**good, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(path))
    with pytest.raises(LoadError, match="unexpected tensor.*model.layers.0.mlp.extra.weight"):
        load_model(llama_folder)
    save_file({**good, name: torch.zeros(3, 3)}, str(path))
    with pytest.raises(LoadError, match=rf"{name} has shape \(3, 3\).*expects \(384, 128\)"):
        load_model(llama_folder)
    path.write_bytes(b"garbage")
    with pytest.raises(LoadError, match="model.safetensors is not a readable safetensors file"):
        load_model(llama_folder)
    path.unlink()
    with pytest.raises(LoadError, match="no model.safetensors or model.safetensors.index.json"):
        load_model(llama_folder)


def test_shard_and_index_errors(tmp_path):
    folder = make_tiny("llama", tmp_path / "s", seed=0, num_shards=2)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    moved = tmp_path / "moved.safetensors"
    shutil.move(folder / shard, moved)
    with pytest.raises(LoadError, match=f"shard {shard} named by model.safetensors.index.json is missing"):
        load_model(folder)
    shutil.move(moved, folder / shard)
    name = next(n for n, f in index["weight_map"].items() if f == shard)
    other = sorted(set(index["weight_map"].values()))[0]
    index_path.write_text(json.dumps({"weight_map": {**index["weight_map"], name: other}}))
    with pytest.raises(LoadError, match=f"tensor {name} is listed in .* under {other} but that file lacks it"):
        load_model(folder)
    index_path.write_text("[]")
    with pytest.raises(LoadError, match="index.json is malformed"):
        load_model(folder)
    index_path.unlink()
    with pytest.raises(LoadError, match="2 safetensors files but no model.safetensors.index.json"):
        load_model(folder)


def test_missing_tokenizer_is_reported(llama_folder):
    (llama_folder / "tokenizer.json").unlink()
    with pytest.raises(LoadError, match="no tokenizer.json"):
        load_model(llama_folder)
    assert load_model(llama_folder, require_tokenizer=False).tokenizer is None


def test_published_layout_errors_name_the_tensor():
    cfg = parse_config(tiny_config("glm_moe_dsa"))
    pre = "model.layers.3.mlp.experts"
    tensors = {f"{pre}.{e}.{p}.weight": torch.zeros(4, 4)
               for e in (0, 1, 3) for p in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(LoadError, match=rf"{pre}\.2\.gate_proj\.weight is missing"):
        load_state(torch.nn.Module(), tensors, cfg)
    conv = {"model.language_model.layers.0.self_attn.q_conv1d.weight": torch.zeros(4, 1, 4)}
    with pytest.raises(LoadError, match="k_conv1d.weight, .*v_conv1d.weight missing"):
        load_state(torch.nn.Module(), conv, cfg)
    with pytest.raises(LoadError, match="x.weight_scale_inv has no weight x.weight"):
        load_state(torch.nn.Module(), {"x.weight_scale_inv": torch.ones(1, 1)}, cfg)


def test_unsupported_architecture_has_no_model_class():
    with pytest.raises(LoadError, match="no model class for architecture 'mamba'"):
        registry.model_class("mamba")
