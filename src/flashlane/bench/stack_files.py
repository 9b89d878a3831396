"""Stack files: a serving stack as a small TOML file, so `compare --stacks-file` can run the study
on servers other than `flashlane serve` (vLLM, SGLang) and a simulator can read which mechanisms
a stack has.

    name = "vllm"
    description = "vLLM with automatic prefix caching"
    mechanism = "what it does that the others do not, for the answer line"

    [hybrid]                     # and [standard]: both roles are required
    command = "vllm serve {model} --host {host} --port {port} --enable-prefix-caching"
    env = { CUDA_VISIBLE_DEVICES = "0,1,2,3" }
    [hybrid.mechanisms]
    prefix_cache = true
    prefix_cache_stateful = true # the cache also restores linear-attention / recurrent state
    batching = "continuous"      # or "static" (then static_batch_size may say how many)
    static_graphs = true         # CUDA graphs / torch.compile decode
    batching_window_ms = 0.0
    speculative_method = "mtp"   # optional: speculative decoding ("mtp" or "ngram") ...
    num_speculative_tokens = 3   # ... with this many drafts per step

A command is a template with {model} {port} {host} {python}. One that starts with
`flashlane serve` gives only flags: compare runs this Python's flashlane with --model, --host and
--port, then its equal-conditions arguments (--dtype, --num-threads, --serve-arg), then these
flags. Any other command is an external server, started exactly as written (it must listen on
{port} and answer GET /health). Every key is checked: an unknown key, mechanism or placeholder,
or a missing role, is an error that names the file and the field.
"""

from __future__ import annotations

import re
import shlex
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROLES = ("hybrid", "standard")
PLACEHOLDERS = ("model", "port", "host", "python")
FLASHLANE = ("flashlane", "serve")
SET_BY_COMPARE = ("--model", "--host", "--port")  # for `flashlane serve` commands


class Mechanisms(BaseModel):
    """What a stack's server does, in a fixed vocabulary (a simulator reads these)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    prefix_cache: bool
    prefix_cache_stateful: bool  # the prefix cache also covers linear-attention / recurrent layers
    batching: Literal["continuous", "static"]
    static_graphs: bool
    batching_window_ms: float = Field(0.0, ge=0)
    static_batch_size: int | None = Field(None, ge=1)
    speculative_method: Literal["mtp", "ngram"] | None = None
    num_speculative_tokens: int = Field(0, ge=0, le=16)

    @model_validator(mode="after")
    def _consistent(self):
        if (self.speculative_method is None) != (self.num_speculative_tokens == 0):
            raise ValueError("speculative_method and num_speculative_tokens (>= 1) go together")
        if self.prefix_cache_stateful and not self.prefix_cache:
            raise ValueError("prefix_cache_stateful needs prefix_cache = true")
        if self.static_batch_size is not None and self.batching != "static":
            raise ValueError('static_batch_size is only for batching = "static"')
        return self


def placeholders(template: str) -> list[str]:
    return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]


class RoleFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    command: str = Field(min_length=1)
    env: dict[str, str] = {}
    mechanisms: Mechanisms

    @field_validator("command")
    @classmethod
    def _command(cls, v: str) -> str:
        try:
            names = placeholders(v)
            tokens = shlex.split(v)
        except ValueError as e:
            raise ValueError(f"not a valid command template: {e}") from None
        unknown = [n for n in names if n not in PLACEHOLDERS]
        if unknown:
            raise ValueError(f"unknown placeholder {{{unknown[0]}}}; known: "
                             + ", ".join(f"{{{p}}}" for p in PLACEHOLDERS))
        if tuple(tokens[:2]) == FLASHLANE:
            given = [t.split("=")[0] for t in tokens[2:] if t.split("=")[0] in SET_BY_COMPARE]
            if given:
                raise ValueError(f"{given[0]} is set by compare for `flashlane serve`; give only the other flags")
        elif "port" not in names:
            raise ValueError("an external server command must listen on {port}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        bad = [k for k in v if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
        if bad:
            raise ValueError(f"not an environment variable name: {bad[0]!r}")
        return v


class StackFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # also a folder name in the results
    description: str
    mechanism: str = ""
    hybrid: RoleFile
    standard: RoleFile


@dataclass(frozen=True)
class RoleSpec:
    command: str
    env: tuple[tuple[str, str], ...] = ()
    mechanisms: Mechanisms | None = None

    @property
    def tokens(self) -> list[str]:
        return shlex.split(self.command)

    @property
    def external(self) -> bool:
        """Not `flashlane serve`: no engine step records, no engine-side attribution."""
        return tuple(self.tokens[:2]) != FLASHLANE


@dataclass(frozen=True)
class Stack:
    name: str
    description: str
    hybrid: RoleSpec
    standard: RoleSpec
    mechanism: str = ""  # what this stack does that the others do not, for the answer line
    source: str = field(default="", compare=False)  # the file it came from

    def role(self, role: str) -> RoleSpec:
        if role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {role!r}")
        return self.hybrid if role == "hybrid" else self.standard

    def flags(self, role: str) -> list[str]:
        """`flashlane serve` flags for this role (literal braces, written ``{{`` ``}}`` in the file,
        unescaped; placeholders kept, see ``fill``); an external server's whole command template."""
        spec = self.role(role)
        if spec.external:
            return spec.tokens
        keep = {p: "{" + p + "}" for p in PLACEHOLDERS}
        return [t.format(**keep) for t in spec.tokens[2:]]

    def external(self, role: str) -> bool:
        return self.role(role).external


def fill(flag: str, values: dict[str, object]) -> str:
    """A ``flags()`` entry with its placeholders filled (its other braces are literal: JSON)."""
    for name, value in values.items():
        flag = flag.replace("{" + name + "}", str(value))
    return flag


def _where(loc: tuple) -> str:
    return ".".join(str(x) for x in loc) or "(top level)"


def _message(path: Path, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = err["loc"]
        if err["type"] == "extra_forbidden":
            model = {(): StackFile, ("hybrid",): RoleFile, ("standard",): RoleFile}.get(tuple(loc[:-1]), Mechanisms)
            what = "mechanism" if model is Mechanisms else "key"
            msg = f"unknown {what} {loc[-1]!r}; known: {', '.join(model.model_fields)}"
        elif err["type"] == "missing":
            msg = f"missing ({'role' if tuple(loc) in [(r,) for r in ROLES] else 'required'})"
        else:
            msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"stack file {path}: {_where(loc)}: {msg}")
    return "\n".join(lines)


def parse_stack(text: str, path: Path | str = "<text>") -> Stack:
    """One stack from TOML text; ValueError naming the file and the field when it is not valid."""
    path = Path(path)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"stack file {path}: not valid TOML: {e}") from None
    try:
        f = StackFile.model_validate(doc)
    except ValidationError as e:
        raise ValueError(_message(path, e)) from None
    roles = {r: RoleSpec(spec.command, tuple(sorted(spec.env.items())), spec.mechanisms)
             for r, spec in (("hybrid", f.hybrid), ("standard", f.standard))}
    return Stack(f.name, f.description, roles["hybrid"], roles["standard"], f.mechanism, str(path))


def load_stack_file(path: Path | str) -> Stack:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"stack file {path}: cannot be read: {e.strerror or e}") from None
    return parse_stack(text, path)


def load_stack_paths(paths: list[Path | str]) -> dict[str, Stack]:
    """Stacks from files and folders (a folder: its *.toml, by file name), in the order given; a
    name defined twice is an error naming both files."""
    out: dict[str, Stack] = {}
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(p.glob("*.toml"))
            if not files:
                raise ValueError(f"--stacks-file: no *.toml stack files in folder {p}")
        else:
            files = [p]
        for f in files:
            s = load_stack_file(f)
            if s.name in out:
                raise ValueError(f"stack {s.name!r} is defined twice: in {out[s.name].source} and in {f}")
            out[s.name] = s
    return out


def command_with_env(spec: RoleSpec, command: list[str]) -> list[str]:
    """The stack's environment as an `env K=V ...` prefix (ServerProcess passes its own
    environment through), so the server log's command line shows it too."""
    return ["env", *(f"{k}={v}" for k, v in spec.env), *command] if spec.env else command
