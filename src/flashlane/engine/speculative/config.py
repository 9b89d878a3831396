"""``speculative_config``: what to draft and how many tokens, named as vLLM names them."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ...acceptance import rate_for_length

METHODS = ("ngram", "mtp")
REJECTION_SAMPLE_METHODS = ("standard", "synthetic")
MAX_SPECULATIVE_TOKENS = 16
MAX_NGRAM = 64
FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
          "rejection_sample_method", "synthetic_acceptance_length")


def _bad(field: str, why: str, value) -> ValueError:
    return ValueError(f"speculative_config.{field} {why}, got {value!r}")


def _int_in(field: str, value, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(field, f"must be an integer in [{low}, {high}]", value)
    return value


def synthetic_rate(length: float, k: int) -> float:
    """The conditional acceptance probability ``p`` (the same at every position) for which the
    mean acceptance length ``1 + p + p^2 + ... + p^k`` equals ``length``."""
    return rate_for_length(length, k)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``rejection_sample_method="synthetic"`` (benchmarks only, as vLLM's): drafts are accepted
    at random so the mean acceptance length is ``synthetic_acceptance_length`` whatever the model
    says; the output is then NOT the model's, and every report that used it says so."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    rejection_sample_method: str = "standard"
    synthetic_acceptance_length: float | None = None

    @property
    def synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"

    @property
    def synthetic_rate(self) -> float | None:
        """Conditional acceptance probability per draft position (synthetic only)."""
        return synthetic_rate(self.synthetic_acceptance_length, self.num_speculative_tokens) if self.synthetic else None

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
        if method not in METHODS:
            raise _bad("method", f"must be one of {', '.join(METHODS)}", method)
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        k = _int_in("num_speculative_tokens", value["num_speculative_tokens"], 1, MAX_SPECULATIVE_TOKENS)
        lo = _int_in("prompt_lookup_min", value.get("prompt_lookup_min", 1), 1, MAX_NGRAM)
        hi = _int_in("prompt_lookup_max", value.get("prompt_lookup_max", max(lo, 4)), 1, MAX_NGRAM)
        if hi < lo:
            raise _bad("prompt_lookup_max", f"must be >= prompt_lookup_min ({lo})", hi)
        rejection = value.get("rejection_sample_method", "standard")
        if rejection not in REJECTION_SAMPLE_METHODS:
            raise _bad("rejection_sample_method", f"must be one of {', '.join(REJECTION_SAMPLE_METHODS)}", rejection)
        length = value.get("synthetic_acceptance_length")
        if rejection == "synthetic":
            if isinstance(length, bool) or not isinstance(length, (int, float)) or not 1 <= length <= k + 1:
                raise _bad("synthetic_acceptance_length", f"must be a number in [1, num_speculative_tokens + 1 "
                           f"= {k + 1}] with rejection_sample_method 'synthetic'", length)
            length = float(length)
        elif length is not None:
            raise _bad("synthetic_acceptance_length", "is only used with rejection_sample_method 'synthetic'", length)
        return cls(method, k, lo, hi, rejection, length)

    def as_dict(self) -> dict:
        out = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            out.update(prompt_lookup_min=self.prompt_lookup_min, prompt_lookup_max=self.prompt_lookup_max)
        if self.synthetic:
            out.update(rejection_sample_method="synthetic",
                       synthetic_acceptance_length=self.synthetic_acceptance_length)
        return out

    def mode(self) -> dict:
        """What a step-cost calibration must share with the engine it prices: the drafter and how
        many drafts (acceptance is the workload's, not the mode's)."""
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}

    def describe(self) -> str:
        what = f"{self.method}, {self.num_speculative_tokens} draft tokens"
        if self.synthetic:
            what += (f", SYNTHETIC acceptance (mean length {self.synthetic_acceptance_length:g}: "
                     "outputs are not the model's; for speed measurements only)")
        return what
