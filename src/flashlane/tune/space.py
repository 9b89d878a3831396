"""Search spaces: named knobs (int, float with optional log scale, categorical, bool), each with
the server's default and optionally a condition on an earlier knob (`when`), read from a JSON (or
YAML, when PyYAML is importable) file or built in for `flashlane serve`.

File format::

    {"knobs": {
      "max_num_seqs": {"type": "int", "low": 1, "high": 64, "log": true, "default": 64},
      "enable_prefix_caching": {"type": "bool", "default": true,
                                "render": {"true": "--enable-prefix-caching",
                                           "false": "--no-enable-prefix-caching"}},
      "checkpoint_share": {"type": "float", "low": 0.02, "high": 0.5, "log": true, "default": 0.1,
                           "when": {"enable_prefix_caching": true},
                           "render": "--checkpoint-share {value}"}}}

`flag` (default `--name-with-dashes`) is how `--model` targets pass the knob to `flashlane
serve`; `render` is what a `{name}` placeholder of a `--serve-command` template becomes: a
format with `{value}`, or a map from the JSON-encoded value to text (default: the value itself).
An inactive conditional knob renders as nothing.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

KINDS = ("int", "float", "categorical", "bool")
FIELDS = {"type", "low", "high", "log", "step", "choices", "default", "when", "flag", "flag_value", "render",
          "help"}


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str
    default: object
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: int | None = None
    choices: tuple = ()
    when: dict = field(default_factory=dict)  # {earlier knob: value or [values]}
    flag: str | None = None
    flag_value: str | dict | None = None      # the flag's argument: a format with {value}, or a map value -> text
                                              # (JSON of the value, as ``render``; default: the value)
    render: str | dict | None = None
    help: str = ""

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def active(self, params: dict) -> bool:
        for other, want in self.when.items():
            wants = want if isinstance(want, list) else [want]
            if other not in params or params[other] not in wants:
                return False
        return True

    def suggest(self, trial):
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=self.step or 1, log=self.log)
        if self.kind == "float":
            return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log)
        if self.kind == "bool":
            return trial.suggest_categorical(self.name, [True, False])
        return trial.suggest_categorical(self.name, list(self.choices))

    def contains(self, value) -> bool:
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "categorical":
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind == "int" and int(value) != value:
            return False
        return self.low <= value <= self.high

    def text(self, value) -> str:
        """The value as a command-line word (floats to 4 significant digits)."""
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, float):
            return format(value, ".4g")
        return "" if value is None else str(value)

    def cli_args(self, value) -> list[str]:
        """`flashlane serve` arguments: a bool is --flag / --no-flag, None leaves the flag out."""
        if value is None:
            return []
        if isinstance(self.flag_value, dict):
            return [self.cli_flag, self.flag_value[json.dumps(value)]]
        if isinstance(value, bool):
            return [self.cli_flag if value else "--no-" + self.cli_flag[2:]]
        text = self.text(value)
        return [self.cli_flag, self.flag_value.format(value=text) if self.flag_value else text]

    def rendered(self, value) -> str:
        """What the knob's `{name}` placeholder becomes in a --serve-command template."""
        if isinstance(self.render, dict):
            return self.render[json.dumps(value)]
        if isinstance(self.render, str):
            return "" if value is None else self.render.format(value=self.text(value))
        return self.text(value)


@dataclass(frozen=True)
class SearchSpace:
    knobs: tuple[Knob, ...]

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.knobs]

    def suggest(self, trial) -> dict:
        """The active knobs' values for an Optuna trial, in order (conditions see earlier knobs)."""
        params: dict = {}
        for k in self.knobs:
            if k.active(params):
                params[k.name] = k.suggest(trial)
        return params

    def defaults(self) -> dict:
        params: dict = {}
        for k in self.knobs:
            if k.active(params):
                params[k.name] = k.default
        return params

    def to_json(self) -> dict:
        return {"knobs": {k.name: {"type": k.kind, **{f: v for f, v in asdict(k).items()
                                                       if f not in ("name", "kind") and v not in (None, (), {}, "")}}
                          for k in self.knobs}}


def _num(where: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{where}: expected a number, got {v!r}")
    return v


def parse_knob(name: str, spec, earlier: dict[str, Knob]) -> Knob:
    where = f"search space: knobs.{name}"
    if not name.isidentifier():
        raise ValueError(f"{where}: a knob name must be an identifier (it is a template placeholder)")
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected an object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; known: {sorted(FIELDS)}")
    kind = spec.get("type")
    if kind not in KINDS:
        raise ValueError(f"{where}.type: expected one of {KINDS}, got {kind!r}")
    if "default" not in spec:
        raise ValueError(f"{where}.default: missing (the server's own value, measured as the baseline)")
    kw: dict = {"log": bool(spec.get("log", False))}
    if kind in ("int", "float"):
        for f in ("low", "high"):
            if f not in spec:
                raise ValueError(f"{where}.{f}: missing for a {kind} knob")
        lo, hi = _num(f"{where}.low", spec["low"]), _num(f"{where}.high", spec["high"])
        if kind == "int" and (int(lo) != lo or int(hi) != hi):
            raise ValueError(f"{where}: low/high of an int knob must be integers")
        if not lo < hi:
            raise ValueError(f"{where}: low ({lo}) must be below high ({hi})")
        if kw["log"] and lo <= 0:
            raise ValueError(f"{where}.log: a log-scale knob needs low > 0, got {lo}")
        kw.update(low=lo, high=hi)
        if "step" in spec:
            step = spec["step"]
            if kind != "int" or isinstance(step, bool) or not isinstance(step, int) or step < 1:
                raise ValueError(f"{where}.step: only int knobs take a step, an integer >= 1")
            if kw["log"] and step != 1:
                raise ValueError(f"{where}.step: a log-scale knob takes no step")
            kw["step"] = step
    elif kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ValueError(f"{where}.choices: expected a non-empty list")
        if any(not (c is None or isinstance(c, (bool, int, float, str))) for c in choices):
            raise ValueError(f"{where}.choices: each choice must be null, a bool, a number or a string")
        if len({json.dumps(c) for c in choices}) != len(choices):
            raise ValueError(f"{where}.choices: a choice is listed twice")
        kw["choices"] = tuple(choices)
    elif any(f in spec for f in ("low", "high", "choices", "step")):
        raise ValueError(f"{where}: a bool knob takes no low/high/step/choices")
    when = spec.get("when", {})
    if not isinstance(when, dict):
        raise ValueError(f"{where}.when: expected an object {{knob: value or [values]}}")
    for other, want in when.items():
        if other not in earlier:
            raise ValueError(f"{where}.when: {other!r} is not a knob defined before {name!r}")
        for w in (want if isinstance(want, list) else [want]):
            if not earlier[other].contains(w):
                raise ValueError(f"{where}.when: {w!r} is not a value knob {other!r} can take")
    render = spec.get("render")
    if render is not None and not isinstance(render, (str, dict)):
        raise ValueError(f"{where}.render: expected a format string with {{value}} or an object value -> text")
    if isinstance(render, dict) and kind not in ("bool", "categorical"):
        raise ValueError(f"{where}.render: a value -> text map fits only bool / categorical knobs")
    flag_value = spec.get("flag_value")
    if isinstance(flag_value, dict):
        if kind != "categorical":
            raise ValueError(f"{where}.flag_value: a value -> argument map fits only categorical knobs")
        missing = [json.dumps(c) for c in kw["choices"] if c is not None and json.dumps(c) not in flag_value]
        if missing or not all(isinstance(v, str) for v in flag_value.values()):
            raise ValueError(f"{where}.flag_value: no argument text for value(s) {', '.join(missing) or '(not text)'}")
    elif flag_value is not None:
        try:
            if not isinstance(flag_value, str) or flag_value.format(value="1") == flag_value:
                raise ValueError("it never uses {value}")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{where}.flag_value: expected a format string using {{value}} (and only it): {e}") from None
    knob = Knob(name=name, kind=kind, default=spec["default"], when=dict(when), flag=spec.get("flag"),
                flag_value=flag_value, render=render, help=str(spec.get("help", "")), **kw)
    if isinstance(render, dict):
        values = [True, False] if kind == "bool" else list(knob.choices)
        missing = [json.dumps(v) for v in values if json.dumps(v) not in render]
        if missing:
            raise ValueError(f"{where}.render: no text for value(s) {', '.join(missing)}")
    if isinstance(render, str):
        try:
            render.format(value="1")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{where}.render: a format string may use only {{value}}: {e}") from None
    if not knob.contains(knob.default):
        raise ValueError(f"{where}.default: {knob.default!r} is outside the knob's range or choices")
    return knob


def parse_space(doc, where: str = "search space") -> SearchSpace:
    if not isinstance(doc, dict) or not isinstance(doc.get("knobs"), dict) or not doc["knobs"]:
        raise ValueError(f"{where}: expected an object with a non-empty 'knobs' object")
    extra = sorted(set(doc) - {"knobs"})
    if extra:
        raise ValueError(f"{where}: unknown top-level field(s) {extra}")
    knobs: dict[str, Knob] = {}
    for name, spec in doc["knobs"].items():
        knobs[name] = parse_knob(name, spec, knobs)
    return SearchSpace(tuple(knobs.values()))


def load_space(path: str | os.PathLike) -> SearchSpace:
    """A search-space file: JSON, or YAML (.yaml / .yml) when PyYAML is installed."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"--search-space: cannot read {p}: {e.strerror}") from None
    if p.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"--search-space: {p} is YAML but PyYAML is not installed; "
                             "use a JSON file") from None
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"--search-space: {p} is not valid YAML: {e}") from None
    else:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--search-space: {p} is not valid JSON: {e}") from None
    return parse_space(doc, where=f"search space {p.name}")


def flashlane_space(cpu_count: int | None = None, offered: dict[str, tuple | None] | None = None,
                    mtp: bool = False) -> SearchSpace:
    """The built-in space for `flashlane serve`, defaults = its own. `offered` maps the serve
    flags that exist to their choices (None: free value); a knob whose flag is not offered is
    left out, and categorical choices are cut to what the flag accepts. ``mtp``: the model has
    MTP layers, so speculative decoding may draft with them too."""
    drafts = [("ngram", k) for k in (1, 2, 3, 4)] + ([("mtp", k) for k in (1, 2, 3)] if mtp else [])
    cpus = cpu_count or os.cpu_count() or 1
    threads = [None] + sorted({n for n in (1, 2, 4, 8, 16, 32, cpus) if n <= cpus})
    knobs = {
        "max_num_seqs": {"type": "int", "low": 1, "high": 64, "log": True, "default": 64},
        "max_num_batched_tokens": {"type": "int", "low": 128, "high": 4096, "log": True, "default": 2048},
        "scheduler": {"type": "categorical", "choices": ["continuous", "static"], "default": "continuous"},
        "max_wait_ms": {"type": "float", "low": 0.0, "high": 10.0, "default": 0.0,
                        "when": {"scheduler": "continuous"}},
        "static_batch_size": {"type": "int", "low": 1, "high": 64, "log": True, "default": 32,
                              "when": {"scheduler": "static"}},
        "page_size": {"type": "categorical", "choices": [8, 16, 32, 64], "default": 16},
        "enable_prefix_caching": {"type": "bool", "default": True},
        "checkpoint_share": {"type": "float", "low": 0.02, "high": 0.5, "log": True, "default": 0.1,
                             "when": {"enable_prefix_caching": True}},
        "quantization": {"type": "categorical", "choices": [None, "int8", "w8a8"], "default": None},
        "num_threads": {"type": "categorical", "choices": threads, "default": None},
        "speculative": {"type": "categorical", "choices": [None] + [f"{m}:{k}" for m, k in drafts], "default": None,
                        "flag": "--speculative-config",
                        "flag_value": {json.dumps(f"{m}:{k}"): json.dumps({"method": m, "num_speculative_tokens": k})
                                       for m, k in drafts},
                        "help": "speculative decoding as method:draft tokens per step (ngram: prompt lookup; mtp: "
                                "the model's own MTP layer; None: off)"},
    }
    if offered is not None:
        kept = {}
        for name, spec in knobs.items():
            flag = spec.get("flag") or "--" + name.replace("_", "-")
            if flag not in offered or (name == "static_batch_size" and "scheduler" not in kept):
                continue
            allowed = offered[flag]
            if allowed is not None and spec["type"] == "categorical":
                spec = {**spec, "choices": [c for c in spec["choices"] if c is None or c in allowed]}
            if any(c not in kept for c in spec.get("when", {})):  # its condition's flag is missing
                spec = {k: v for k, v in spec.items() if k != "when"}
            kept[name] = spec
        knobs = kept
    return parse_space({"knobs": knobs}, where="built-in flashlane search space")
