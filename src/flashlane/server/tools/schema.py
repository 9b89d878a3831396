"""JSON schemas that make a forced tool choice a grammar for the engine (``SamplingParams.structured``).

A named function: the output is its arguments object. ``"required"``: an array of one or more
``{"name": <one of the tools>, "parameters": <that tool's arguments>}`` (vLLM's shape), at most
one with ``parallel_tool_calls: false``.
"""

from __future__ import annotations

# a tool without parameters takes an empty object (not any object: a model would fill it with keys)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def arguments_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or NO_ARGUMENTS


def required_schema(tools: list[dict], parallel: bool) -> dict:
    one_of_the_tools = [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": arguments_schema(t)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of_the_tools}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
