"""Engine logprobs (per generated token: {token id: logprob}, top-k plus the chosen one) in the
two OpenAI layouts: completions' parallel lists and chat's per-token objects."""

from __future__ import annotations

import math
from functools import lru_cache

FLOOR = -9999.0  # what -inf is reported as (JSON has no infinity)


def _lp(v: float | None) -> float | None:
    if v is None or math.isnan(v):
        return None
    return max(v, FLOOR)


class TokenText:
    """Token id -> its text, memoised (the same ids come back at every step). Special tokens keep
    their text (as in vLLM); without a tokenizer a token reads ``token_id:N`` (vLLM's spelling)."""

    def __init__(self, tokenizer):
        if tokenizer is None:
            self._decode = lambda t: f"token_id:{t}"
        else:
            self._decode = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t], skip_special_tokens=False))

    def __call__(self, token: int) -> str:
        return self._decode(token)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(text_of: TokenText, token_ids: list[int], entries: list[dict[int, float]], k: int,
                        offset: int = 0) -> dict:
    """``offset``: text offset of the first token (streaming continues a running offset)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, entry in zip(token_ids, entries):
        s = text_of(tok)
        out["tokens"].append(s)
        out["token_logprobs"].append(_lp(entry.get(tok)))
        out["top_logprobs"].append({text_of(t): _lp(v) for t, v in _top(entry, k or 1)})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def chat_logprobs(text_of: TokenText, token_ids: list[int], entries: list[dict[int, float]], k: int) -> dict:
    content = []
    for tok, entry in zip(token_ids, entries):
        s = text_of(tok)
        content.append({
            "token": s, "logprob": _lp(entry.get(tok)), "bytes": list(s.encode()),
            "top_logprobs": [{"token": text_of(t), "logprob": _lp(v), "bytes": list(text_of(t).encode())}
                             for t, v in _top(entry, k)],
        })
    return {"content": content}


def new_entries(out) -> tuple[list[int], list[dict[int, float]]]:
    """The tokens this output added and their logprob entries. The engine's logprobs list grows
    as it steps, so it is indexed by position, never taken whole."""
    n = len(out.token_ids)
    start = n - len(out.delta_token_ids)
    entries = (out.logprobs or [])[start:n]
    return out.token_ids[start:n], entries
