"""A large batch of token-id prompts kept out of the schema validation.

pydantic validates a request body in one call that holds the GIL (measured: 1.8 s for 1,000
prompts of 15,000 ids, a stall of the whole event loop). A completions prompt that is a list
of lists of ids is checked here instead, on the worker thread that parsed the body, one prompt
per pass in C: if it is what the schema's ``list[list[TokenId]]`` accepts, the body handed to
validation holds a one-id stand-in (validated the same way, by the same union branch) and the
endpoint gets the real prompt back (``GuardedRoute``). Anything else is left to the schema, so
its errors are unchanged.
"""

from __future__ import annotations

import functools
from array import array
from contextvars import ContextVar

from pydantic import BaseModel

from .protocol import INT64_MAX

_STAND_IN = [[0]]
# the prompt set aside for the request being handled (its task's context)
_SET_ASIDE: ContextVar[list | None] = ContextVar("flashlane_set_aside_prompt", default=None)


def is_id_batch(prompt) -> bool:
    """What ``list[list[TokenId]]`` accepts in strict mode: non-empty lists of ints (not
    bools) in [0, 2**63 - 1], in a non-empty list."""
    if type(prompt) is not list or not prompt:
        return False
    for ids in prompt:
        if type(ids) is not list or not ids or set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) > INT64_MAX:
            return False
    return True


def set_aside(data) -> list | None:
    """Swap a body's token-id batch prompt for the stand-in; the real prompt, or None when the
    body is left as it was. Its prompts become int64 arrays, which the cyclic GC never looks
    into (it walks every list, and every new tuple once, at collections that hold the GIL:
    measured 0.07-0.15 s on the event loop with 15 M ids held in lists or new tuples); they are
    also 8 bytes an id and pickle as one buffer on their way to the engine process."""
    if isinstance(data, dict) and is_id_batch(prompt := data.get("prompt")):
        data["prompt"] = _STAND_IN
        for i, ids in enumerate(prompt):
            prompt[i] = array("q", ids)
        return prompt
    return None


def remember(prompt: list | None) -> None:
    _SET_ASIDE.set(prompt)


def restoring(endpoint):
    """``endpoint``, with the set-aside prompt put back into its validated body first."""

    @functools.wraps(endpoint)
    async def endpoint_with_prompt(*args, **kwargs):
        prompt = _SET_ASIDE.get()
        if prompt is not None:
            _SET_ASIDE.set(None)
            for value in kwargs.values():
                if isinstance(value, BaseModel) and "prompt" in type(value).model_fields:
                    value.prompt = prompt
        return await endpoint(*args, **kwargs)

    return endpoint_with_prompt
