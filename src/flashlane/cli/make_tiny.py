"""`flashlane make-tiny --arch A --out DIR`: write a small random Hugging Face checkpoint folder.

glm5_next / glm_moe_dsa use the tiny-flash / tiny-standard preset shapes; llama a SmolLM2-like
miniature. All share the tiny byte-level BPE tokenizer. ``--published-names`` writes tensors
under the published checkpoint layout (spec §3) instead of transformers' in-memory names.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import presets
from .help import HelpFormatter

ARCHS = ("glm5_next", "glm_moe_dsa", "llama")


def tiny_llama_config() -> dict:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "dtype": "float32",
        "vocab_size": presets.TINY_VOCAB, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": presets.tiny_eos_ids(),
    }


def tiny_config(arch: str) -> dict:
    if arch == "glm5_next":
        return presets.tiny_flash_config()
    if arch == "glm_moe_dsa":
        return presets.tiny_standard_config()
    if arch == "llama":
        return tiny_llama_config()
    raise ValueError(f"--arch {arch!r} is not one of {', '.join(ARCHS)}")


def make_tiny(arch: str, out: str | Path, seed: int = 0, published_names: bool = False,
              num_shards: int = 1) -> Path:
    from ..models.registry import write_random_checkpoint

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} exists and is not empty")
    config = tiny_config(arch)
    presets.write_tiny_tokenizer(out)
    write_random_checkpoint(out, config, seed=seed, published_names=published_names, num_shards=num_shards)
    return out


def add_parser(sub):
    p = sub.add_parser("make-tiny", help="write a small random HF-format checkpoint folder",
                       formatter_class=HelpFormatter)
    p.add_argument("--arch", required=True, choices=ARCHS, help="model architecture")
    p.add_argument("--out", required=True, help="folder to create (must be empty or absent)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--published-names", action="store_true",
                   help="use the published checkpoint tensor names instead of transformers' in-memory ones")
    p.add_argument("--shards", type=int, default=1, help="split the weights into this many safetensors shards")
    return p


def run(args) -> int:
    try:
        folder = make_tiny(args.arch, args.out, args.seed, args.published_names, args.shards)
    except (FileExistsError, ValueError) as exc:
        print(f"make-tiny: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0
