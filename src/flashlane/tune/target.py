"""What a trial starts: `flashlane serve --model M` with the knobs as flags, or a user's command
template with `{port}`, `{host}`, `{python}` and one `{knob}` placeholder per knob (so the same
study drives vLLM or SGLang). Templates are checked against the space before any server starts."""

from __future__ import annotations

import shlex
import string
import sys
from dataclasses import dataclass, field

from flashlane.bench.server_launch import serve_command

from .space import SearchSpace

FIXED_PLACEHOLDERS = ("port", "host", "python")
HOST = "127.0.0.1"


@dataclass
class FlashlaneTarget:
    """`flashlane serve --model M [extra args] [knob flags]`."""
    model: str
    space: SearchSpace
    extra_args: list[str] = field(default_factory=list)

    def args(self, params: dict) -> list[str]:
        by_name = {k.name: k for k in self.space.knobs}
        return [a for name, v in params.items() for a in by_name[name].cli_args(v)]

    def command(self, params: dict, port: int) -> list[str]:
        return serve_command(self.model, port, None, self.extra_args + self.args(params))

    def paste(self, params: dict) -> str:
        """The ready-to-paste command line for `params`."""
        return shlex.join(["flashlane", "serve", "--model", self.model] + self.extra_args + self.args(params))

    @property
    def served_model(self) -> str | None:
        return self.model

    def describe(self) -> str:
        return shlex.join(["flashlane", "serve", "--model", self.model] + self.extra_args)


def template_fields(template: str) -> list[str]:
    try:
        return [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"--serve-command: malformed template {template!r}: {e}") from None


@dataclass
class TemplateTarget:
    template: str
    space: SearchSpace

    def __post_init__(self):
        fields = template_fields(self.template)
        names = set(self.space.names)
        bad = sorted({f for f in fields if f not in names and f not in FIXED_PLACEHOLDERS})
        if bad:
            plain = [f for f in bad if f.isidentifier()]
            raise ValueError(
                f"--serve-command: unknown placeholder(s) {', '.join('{' + f + '}' for f in bad)}; "
                f"the template may use {{port}}, {{host}}, {{python}} and the knobs "
                f"{', '.join(self.space.names)}" + ("" if len(plain) == len(bad) else
                                                   " (write a literal brace as {{ or }})"))
        if "port" not in fields:
            raise ValueError("--serve-command: the template needs a {port} placeholder (each trial's server "
                             "listens on a free port)")
        missing = [n for n in self.space.names if n not in fields]
        if missing:
            raise ValueError(f"--serve-command: knob(s) {', '.join(missing)} have no placeholder in the template; "
                             f"add {' '.join('{' + n + '}' for n in missing)} or drop them from the search space")
        unrendered = [k.name for k in self.space.knobs if k.when and k.render is None]
        if unrendered:
            raise ValueError(
                f"--serve-command: conditional knob(s) {', '.join(unrendered)} render as nothing when inactive, "
                f"so their flag must come with them: give each a 'render' such as "
                f"\"--{unrendered[0].replace('_', '-')} {{value}}\" in the search-space file")

    def _format(self, params: dict, port: int | str, host: str) -> str:
        values = {k.name: (k.rendered(params[k.name]) if k.name in params else "") for k in self.space.knobs}
        return self.template.format(port=port, host=host, python=sys.executable, **values)

    def command(self, params: dict, port: int) -> list[str]:
        return shlex.split(self._format(params, port, HOST))

    def paste(self, params: dict) -> str:
        return shlex.join(shlex.split(self._format(params, 8000, "0.0.0.0")))

    @property
    def served_model(self) -> str | None:
        return None  # the first model the server lists

    def describe(self) -> str:
        return self.template
