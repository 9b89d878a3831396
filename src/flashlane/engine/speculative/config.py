"""``speculative_config``: what to draft and how many tokens, named as vLLM names them."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
MAX_NGRAM = 64
FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def _bad(field: str, why: str, value) -> ValueError:
    return ValueError(f"speculative_config.{field} {why}, got {value!r}")


def _int_in(field: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(field, f"must be an integer in [{low}, {high}]", value)
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None (off), a dict or its JSON text; a ValueError naming the field otherwise."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e.msg} at column {e.colno}): "
                                 f"{value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(FIELDS)})")
        method = value.get("method")
        if method == "mtp":
            raise _bad("method", "'mtp' is not available yet: the MTP drafter is not built in this "
                       f"version; known: {', '.join(METHODS)}", method)
        if method not in METHODS:
            raise _bad("method", f"must be one of {', '.join(METHODS)}", method)
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        k = _int_in("num_speculative_tokens", value["num_speculative_tokens"], 1, MAX_SPECULATIVE_TOKENS)
        lo = _int_in("prompt_lookup_min", value.get("prompt_lookup_min", 1), 1, MAX_NGRAM)
        hi = _int_in("prompt_lookup_max", value.get("prompt_lookup_max", max(lo, 4)), 1, MAX_NGRAM)
        if hi < lo:
            raise _bad("prompt_lookup_max", f"must be >= prompt_lookup_min ({lo})", hi)
        return cls(method, k, lo, hi)

    def as_dict(self) -> dict:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
