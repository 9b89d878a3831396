"""Model identifiers -> ready models: a checkpoint folder, a ``.gguf`` file, or a preset name."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import presets
from ..config import ModelConfig, load_config, parse_config
from .loader import (FP32_PARAMS, LoadError, cast_model, init_random, is_mtp_name, load_state, random_state,
                     read_tensors, resolve_dtype, save_checkpoint)
from .protocol import CausalLM, OptionalMtp, PostLoad, fp32_param_names
from .tokenizer import Tokenizer

MODEL_CLASSES = {
    "glm5_next": ("flashlane.models.glm5_next", "Glm5NextForCausalLM"),
    "glm_moe_dsa": ("flashlane.models.glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    "llama": ("flashlane.models.llama", "LlamaForCausalLM"),
}
LOAD_FORMATS = ("auto", "dummy")


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    path: Path | None


def model_class(arch: str) -> type[nn.Module]:
    if arch not in MODEL_CLASSES:
        raise LoadError(f"no model class for architecture {arch!r} (known: {', '.join(MODEL_CLASSES)})")
    module, cls = MODEL_CLASSES[arch]
    # a model module that fails to import is a bug, not an unsupported checkpoint: let it raise
    return getattr(importlib.import_module(module), cls)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", with_mtp: bool | None = None) -> nn.Module:
    """``with_mtp``: build the next-token-prediction block (None = the class default); only
    passed to classes that take it (``OptionalMtp``)."""
    cls = model_class(cfg.arch)
    kwargs = {}
    if with_mtp is not None and issubclass(cls, OptionalMtp):
        kwargs["with_mtp"] = with_mtp
    with torch.device(device):
        return cls(cfg, **kwargs)


def finish(model: nn.Module) -> nn.Module:
    if isinstance(model, PostLoad):
        model.post_load()
    return model.eval().requires_grad_(False)


def load_model(model_id: str | Path, dtype: str | torch.dtype = "auto", seed: int = 0,
               device: str | torch.device = "cpu", load_format: str = "auto",
               require_tokenizer: bool = True) -> LoadedModel:
    """Resolve ``model_id`` and load it. ``load_format="dummy"`` ignores checkpoint tensors and
    initialises every weight from ``seed`` (the folder then needs only ``config.json``)."""
    if load_format not in LOAD_FORMATS:
        raise LoadError(f"load_format {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    name = str(model_id)
    if name in presets.PRESETS:
        return _load_path(preset_folder(name), dtype, seed, device, load_format, require_tokenizer, name)
    path = Path(name).expanduser()
    if path.suffix == ".gguf" or path.is_dir():
        if not path.exists():
            raise LoadError(f"model {name!r}: {path} does not exist")
        label = path.stem if path.is_file() else path.name
        return _load_path(path, dtype, seed, device, load_format, require_tokenizer, label)
    raise LoadError(f"unknown model {name!r}: not a checkpoint folder, not a .gguf file and not a preset "
                    f"(presets: {', '.join(presets.PRESETS)})")


def preset_folder(name: str) -> Path:
    """A preset's checkpoint folder (tiny presets: created on first use, random and seeded, with
    bfloat16 weights) or its GGUF file. ``flashlane.presets`` holds the names, configs and the
    tokenizer; the weights are written here, so the import runs one way (models -> presets)."""
    return presets.preset_path(name, write_weights=_write_preset_weights)


def _write_preset_weights(folder: Path, config: dict[str, Any], seed: int) -> None:
    write_random_checkpoint(folder, config, seed=seed, storage_dtype="bfloat16")


def _load_path(path: Path, dtype, seed, device, load_format, require_tokenizer, name) -> LoadedModel:
    if path.is_file():
        return _load_gguf(path, dtype, seed, device, load_format, name)
    cfg = load_config(path)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    if load_format == "dummy":
        model = init_random(cast_model(build_model(cfg, device), torch_dtype), seed)
    else:
        tensors = read_tensors(path)
        model = cast_model(build_model(cfg, device, with_mtp=any(is_mtp_name(n, cfg) for n in tensors)), torch_dtype)
        load_state(model, tensors, cfg)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_folder(path)
    elif require_tokenizer:
        raise LoadError(f"no tokenizer.json in {path}: add one, or use token ids only with skip_tokenizer_init=True "
                        f"(--skip-tokenizer-init on `flashlane generate` / `flashlane serve`)")
    return LoadedModel(finish(model), cfg, tokenizer, name, path)


def _load_gguf(path: Path, dtype, seed, device, load_format, name) -> LoadedModel:
    from .gguf_loader import gguf_config, gguf_tensors, open_gguf, tokenizer_from_gguf

    reader = open_gguf(path)
    raw = gguf_config(reader)
    cfg = parse_config(raw)
    model = cast_model(build_model(cfg, device), resolve_dtype(dtype, cfg, device))
    if load_format == "dummy":
        init_random(model, seed)
    else:
        load_state(model, gguf_tensors(reader, raw), cfg)
    return LoadedModel(finish(model), cfg, tokenizer_from_gguf(reader), name, path)


# ---- writing random checkpoints (presets, make-tiny, tests) --------------------------------

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def random_checkpoint(config: dict[str, Any], seed: int = 0, published_names: bool = False,
                      storage_dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The tensors of a randomly initialised checkpoint for ``config`` (a tied lm_head is left
    out, as transformers' ``save_pretrained`` does)."""
    from .weights import to_published

    cfg = parse_config(config)
    with torch.device("meta"):
        skeleton = model_class(cfg.arch)(cfg)
    skip = ["lm_head.weight"] if cfg.tie_word_embeddings else []
    keep = fp32_param_names(skeleton, FP32_PARAMS)
    state = random_state(skeleton, seed, skip=skip)
    target = STORAGE_DTYPES[storage_dtype]
    state = {n: (t if any(k in n for k in keep) else t.to(target)) for n, t in state.items()}
    return to_published(state, cfg) if published_names else state


def write_random_checkpoint(folder: str | Path, config: dict[str, Any], seed: int = 0,
                            published_names: bool = False, storage_dtype: str = "float32",
                            num_shards: int = 1) -> Path:
    tensors = random_checkpoint(config, seed, published_names, storage_dtype)
    return save_checkpoint(folder, tensors, config, num_shards=num_shards)

