"""Fields other OpenAI-compatible servers accept that flashlane does not implement.

Ignoring them would change what the caller gets without saying so (a ``min_tokens`` that never
holds, a ``repetition_penalty`` that never applies), so each is declared on the request model and
refused with a 400 naming it unless it holds the one value that means "off". Fields that cannot
change the output (``store``, ``metadata``, ``service_tier``, ...) and unknown fields are ignored,
as vLLM does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, create_model

# name -> (the value that means "off", what to say); None: only absent or null
SAMPLING = {
    "repetition_penalty": (1.0, "only 1.0"),
    "length_penalty": (1.0, "only 1.0; there is no beam search"),
    "min_tokens": (0, "only 0"),
    "use_beam_search": (False, "only false"),
    "include_stop_str_in_output": (False, "only false"),
    "bad_words": (None, "it must be null"),
    "allowed_token_ids": (None, "it must be null"),
    "truncate_prompt_tokens": (None, "it must be null: a prompt that does not fit is a 400"),
    "logits_processors": (None, "it must be null"),
    "structured_outputs": (None, "use 'response_format'"),
    "guided_json": (None, "use 'response_format' with a json_schema"),
    "guided_regex": (None, "use 'response_format'"),
    "guided_choice": (None, "use 'response_format' with a json_schema enum"),
    "guided_grammar": (None, "use 'response_format'"),
    "guided_decoding_backend": (None, "use 'response_format'"),
}
CHAT = {
    "functions": (None, "the deprecated API; use 'tools' ([{'type': 'function', 'function': {...}}])"),
    "function_call": (None, "the deprecated API; use 'tools' and 'tool_choice'"),
    "audio": (None, "this server produces text only"),
    "modalities": (None, "this server produces text only"),
    "prediction": (None, "predicted outputs are not implemented"),
    "web_search_options": (None, "this server has no web search"),
    "chat_template": (None, "the server uses the model's chat template"),
    "chat_template_kwargs": (None, "the server uses the model's chat template as it is"),
    "continue_final_message": (False, "only false"),
    "add_generation_prompt": (True, "only true"),
    "documents": (None, "it must be null"),
    "echo": (False, "only false on chat completions; /v1/completions has echo"),
    "prompt_logprobs": (None, "it must be null on chat completions; /v1/completions has it"),
}


_SPECS: dict[type, dict[str, tuple[Any, str]]] = {}


def refusing_model(name: str, base: type[BaseModel], spec: dict[str, tuple[Any, str]]) -> type[BaseModel]:
    """A base model declaring ``spec``'s fields: any value parses (so the refusal, not a type
    error, is what the caller reads) and the JSON schema says which one value is accepted."""
    fields = {}
    for field, (off, why) in spec.items():
        schema = {"const": off} if off is not None else {"type": "null"}
        fields[field] = (Any, Field(None, description=f"not supported: {why}", json_schema_extra=schema))
    model = create_model(name, __base__=base, **fields)
    _SPECS[model] = spec
    return model


def check(body: BaseModel) -> tuple[str, str] | None:
    """(field, message) for the first refused field of ``body`` set to anything but its "off" value."""
    for cls in type(body).__mro__:
        for field, (off, why) in _SPECS.get(cls, {}).items():
            if not _is_off(getattr(body, field), off):
                return field, f"'{field}' is not supported ({why})"
    return None


def _is_off(value, off) -> bool:
    if value is None:
        return True
    if isinstance(value, bool) or isinstance(off, bool):
        return value is off
    return off is not None and isinstance(value, (int, float)) and value == off
