"""Turn a model identifier into a named ModelConfig without touching weights or torch.

Identifiers, tried in order: a config.json path or a checkpoint folder; a full-size preset
shipped here (``presets/<name>.json``: ``glm-5.3-flash``, ``glm-5.3``); a tiny preset of
``flashlane.presets`` (torch-free registry of HF config dicts; no files are created).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..config import ConfigError, ModelConfig, load_config, parse_config


@dataclass(frozen=True)
class NamedConfig:
    name: str
    cfg: ModelConfig
    source: str  # where the config came from, for the report


def full_size_presets() -> list[str]:
    folder = resources.files(__package__) / "presets"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def full_size_preset_dict(name: str) -> dict:
    path = resources.files(__package__) / "presets" / f"{name}.json"
    if "/" in name or "\\" in name or not path.is_file():
        raise KeyError(name)
    return json.loads(path.read_text())


def _flashlane_preset_dict(name: str) -> dict | None:
    """Config dict of a flashlane preset (tiny-flash, tiny-standard, smollm2-135m), or None."""
    from ..presets import PRESETS, preset_config

    return preset_config(name) if name in PRESETS else None


def _flashlane_preset_names() -> list[str]:
    from ..presets import PRESETS

    return sorted(PRESETS)


def resolve_model(model_id: str) -> NamedConfig:
    path = Path(model_id).expanduser()
    if path.exists():
        cfg = load_config(path)
        name = path.name if path.is_dir() else (path.parent.name if path.name == "config.json" else path.stem)
        return NamedConfig(name=name or str(path), cfg=cfg, source=str(path))
    try:
        return NamedConfig(model_id, parse_config(full_size_preset_dict(model_id)), f"full-size preset {model_id}")
    except KeyError:
        pass
    data = _flashlane_preset_dict(model_id)
    if data is not None:
        return NamedConfig(model_id, parse_config(data), f"flashlane preset {model_id}")
    known = ", ".join(full_size_presets() + _flashlane_preset_names())
    raise ConfigError(f"model {model_id!r} is neither a config.json / checkpoint folder nor a preset ({known})")
