"""Configurations to evaluate: a grid spec (``quantization=none,int8;kv_cache_dtype=auto,int8``)
or a JSON file holding a list of option dicts. Checked before any model loads."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..engine.engine_args import EngineArgs

MODEL_KEY = "model"   # a different checkpoint with the same tokenizer (e.g. a pruned one)
# options that only change how the engine is driven or stored, never what it computes
NOT_SWEPT = ("device", "skip_tokenizer_init", "disk_cache_dir", "disk_cache_bytes", "disk_load_timeout_s",
             "host_cache_memory")


@dataclass
class Configuration:
    label: str
    options: dict = field(default_factory=dict)   # engine options overriding the base ones (and maybe "model")


def option_names() -> list[str]:
    return sorted({f.name for f in fields(EngineArgs)} - set(NOT_SWEPT)) + [MODEL_KEY]


def _value(text: str):
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def _check_names(options: dict, where: str) -> dict:
    known = option_names()
    out = {}
    for name, value in options.items():
        key = name.replace("-", "_")
        if key not in known:
            raise ValueError(f"--sweep {where}: unknown option {name!r} (known: {', '.join(known)})")
        out[key] = value
    return out


def parse_sweep(spec: str) -> list[dict]:
    """Option dicts, one per configuration, names checked against EngineArgs."""
    path = Path(spec)
    if spec.endswith(".json") or path.is_file():
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"--sweep {spec}: cannot read ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--sweep {spec}: not valid JSON ({e.msg})") from None
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise ValueError(f"--sweep {spec}: expected a JSON list of option objects")
        return [_check_names(d, f"{spec}[{i}]") for i, d in enumerate(data)]
    axes = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, eq, values = part.partition("=")
        if not eq or not values.strip():
            raise ValueError(f"--sweep: {part!r} is not NAME=V1,V2,...")
        key = next(iter(_check_names({name.strip(): None}, repr(part))))
        axes.append((key, [_value(v) for v in values.split(",")]))
    if not axes:
        raise ValueError("--sweep: an empty spec")
    return [dict(zip([k for k, _ in axes], combo)) for combo in itertools.product(*[v for _, v in axes])]


def label(options: dict) -> str:
    return ", ".join(f"{k}={'none' if v is None else v}" for k, v in options.items()) or "engine options as given"


def check_options(base: dict, options: dict) -> dict:
    """The engine kwargs of one configuration, validated (a bad value is a ValueError now, not
    after minutes of loading)."""
    kwargs = {**base, **{k: v for k, v in options.items() if k != MODEL_KEY}}
    try:
        EngineArgs.from_kwargs(**kwargs).validate()
    except TypeError as e:
        raise ValueError(str(e)) from None
    return kwargs
