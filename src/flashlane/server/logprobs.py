"""Engine logprobs (per token: {token id: logprob}, top-k plus the chosen one) in the two OpenAI
layouts, completions' parallel lists and chat's per-token objects, and in vLLM's
``prompt_logprobs`` layout."""

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


def completion_logprobs(text_of: TokenText, token_ids: list[int], entries: list[dict[int, float] | None], k: int,
                        offset: int = 0) -> dict:
    """``offset``: text offset of the first token (streaming continues a running offset). An entry
    of None (an echoed prompt's first token: nothing precedes it) reads null in both lists."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, entry in zip(token_ids, entries):
        s = text_of(tok)
        out["tokens"].append(s)
        out["token_logprobs"].append(None if entry is None else _lp(entry.get(tok)))
        out["top_logprobs"].append(None if entry is None else {text_of(t): _lp(v) for t, v in _top(entry, k or 1)})
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def prompt_logprobs(text_of: TokenText, prompt_ids, entries: list[dict[int, float] | None], k: int,
                    engine_k: int) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}}, the prompt token first, then the top ``k``. The engine's entries hold its top
    ``engine_k`` plus the prompt token, so a rank (1 + tokens more likely) is exact for every token
    among that top and unknown (None) for a prompt token outside it."""
    out: list[dict | None] = []
    for tok, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        ranked = len(entry) <= engine_k      # the prompt token is one of the engine's top engine_k

        def item(t: int, v: float, exact: bool) -> dict:
            rank = 1 + sum(1 for u in entry.values() if u > v) if exact else None
            return {"logprob": _lp(v), "rank": rank, "decoded_token": text_of(t)}

        row = {str(tok): item(tok, entry[tok], ranked)}
        for t, v in _top(entry, k):
            row.setdefault(str(t), item(t, v, True))
        out.append(row)
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

