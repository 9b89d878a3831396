"""What a chat request asks of tools: checked against OpenAI's rules, then a plan the handler
follows (what the template gets, the grammar the engine decodes under, how the output is read)."""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.sampling_params import StructuredOutput
from ...engine.structured_output import SchemaError, grammar_text
from ..errors import bad_request, clip
from .base import ToolParser
from .forced import NamedCallParser, RequiredCallsParser
from .glm import glm_parser
from .hermes import hermes_parser
from .schema import arguments_schema, required_schema


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None    # for the chat template (None: none were sent)
    choice: str                 # "none", "auto", "required" or "named"
    name: str | None = None     # the named function
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def structured(self) -> StructuredOutput | None:
        """The grammar of a forced choice, its schemas checked (a 400 naming the tool's parameters)."""
        if not self.forced:
            return None
        for i, tool in enumerate(self.tools):
            if self.choice == "required" or tool["function"]["name"] == self.name:
                _checked(StructuredOutput(json_schema=arguments_schema(tool)), f"tools.{i}.function.parameters")
        if self.choice == "named":
            return StructuredOutput(json_schema=arguments_schema(self._tool(self.name)))
        return _checked(StructuredOutput(json_schema=required_schema(self.tools, self.parallel)), "tools")

    def parser(self, call_format: str) -> ToolParser | None:
        """A fresh parser for one choice's output (``call_format``: "glm" or "hermes"); None:
        the output is plain content."""
        if self.choice == "named":
            return NamedCallParser(self.name)
        if self.choice == "required":
            return RequiredCallsParser()
        if self.choice == "auto":
            max_calls = None if self.parallel else 1
            if call_format == "glm":
                return glm_parser(self._param_schemas(), max_calls)
            return hermes_parser(max_calls)
        return None

    def _tool(self, name: str) -> dict:
        return next(t for t in self.tools if t["function"]["name"] == name)

    def _param_schemas(self) -> dict[str, dict]:
        out = {}
        for t in self.tools:
            props = (t["function"].get("parameters") or {}).get("properties")
            out[t["function"]["name"]] = props if isinstance(props, dict) else {}
        return out


def plan_tools(body) -> ToolPlan:
    """The request's tool fields checked (400s naming the field), as a plan. (``functions`` and
    ``function_call``, the deprecated API, are refused with the other fields in ``refused_fields``.)"""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    if tools:
        _check_tools(tools)
    choice, name = body.tool_choice, None
    if choice is None:   # OpenAI's default
        choice = "auto" if tools else "none"
    elif not isinstance(choice, str):
        name, choice = choice.function.name, "named"
    if choice != "none" and not tools:
        what = f"naming '{name}'" if name is not None else f"'{choice}'"
        raise bad_request(f"tool_choice {what} needs 'tools'", "tool_choice")
    if name is not None and all(t["function"]["name"] != name for t in tools):
        raise bad_request(f"tool_choice names the function '{name}', which is not in 'tools' "
                          f"({clip(', '.join(t['function']['name'] for t in tools))})", "tool_choice")
    return ToolPlan(tools, choice, name, body.parallel_tool_calls)


def _check_tools(tools: list[dict]) -> None:
    seen = set()
    for i, t in enumerate(tools):
        fn = t["function"]
        if fn["name"] in seen:
            raise bad_request(f"two tools are named '{fn['name']}'; tool names must be unique",
                              f"tools.{i}.function.name")
        seen.add(fn["name"])
        params = fn.get("parameters")
        if params is not None and params.get("type", "object") != "object":
            raise bad_request("a function's parameters must be a JSON schema of type 'object' "
                              f"(got type {params.get('type')!r})", f"tools.{i}.function.parameters")


def _checked(structured: StructuredOutput, param: str) -> StructuredOutput:
    try:
        grammar_text(structured)
    except SchemaError as exc:
        raise bad_request(f"'{param}' {exc.reason}", param) from None
    return structured
