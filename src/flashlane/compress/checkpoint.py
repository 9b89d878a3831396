"""Write a compressed model as a Hugging Face checkpoint folder (config, safetensors, tokenizer).

Tensors keep flashlane's in-memory names, which are transformers' names (llama, glm_moe_dsa,
glm5_next), so both load the folder. The folder is built next to ``--out`` and renamed into
place at the end: a failed run leaves nothing behind.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..models.loader import is_mtp_name, save_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def check_out_dir(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not an empty folder")
    return out


def trunk_state(model, cfg) -> dict[str, torch.Tensor]:
    """The model's tensors to save: no tied ``lm_head``, no next-token-prediction (MTP) layers."""
    state = model.state_dict()
    return {n: t for n, t in state.items()
            if not is_mtp_name(n, cfg) and not (cfg.tie_word_embeddings and n == "lm_head.weight")}


def text_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the text model's fields (glm5_next nests them under ``text_config``)."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def without_mtp(raw: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(raw)
    text = text_fields(config)
    if "num_nextn_predict_layers" in text or config.get("model_type") in ("glm5_next", "glm_moe_dsa"):
        text["num_nextn_predict_layers"] = 0
    return config


def write_tokenizer(folder: Path, source: Path | None, tokenizer) -> None:
    """Copy the source folder's tokenizer files, or serialise a tokenizer built from a GGUF."""
    if source is not None and source.is_dir() and (source / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, folder / name)
        return
    if tokenizer is None:
        return
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
          "eos_token": tokenizer.eos_token, "clean_up_tokenization_spaces": False}
    if tokenizer.has_own_chat_template:
        tc["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    gen = {"eos_token_id": list(tokenizer.eos_token_ids)}
    if tokenizer.bos_token_id is not None:
        gen["bos_token_id"] = tokenizer.bos_token_id
    (folder / "generation_config.json").write_text(json.dumps(gen) + "\n")


def write_checkpoint(out: str | Path, state: dict[str, torch.Tensor], config: dict[str, Any],
                     source: Path | None = None, tokenizer=None) -> Path:
    out = check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_tokenizer(tmp, source, tokenizer)
        save_checkpoint(tmp, state, config)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
