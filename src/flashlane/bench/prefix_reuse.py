"""Token-level prefix-cache hit rates from request records: what the server reported, and what
a perfect cache with the server's page size could have reused (the theoretical rate).

A request's reusable prefix, in the server's own token counts (`usage`), is the longest of:
- its conversation's history: the nearest earlier request it extends (`extends_request_id`,
  skipping requests without usage) contributes its prompt tokens, plus its completion tokens
  minus one when its output text was fed back verbatim (`output_fed_back`; the last generated
  token never ran through the model, so it has no KV). A recorded-mode answer is synthetic text,
  not what the model generated, so only the prompt counts;
- the shared system prompt (`shared_prefix_tokens`), once any request carrying it had finished
  prefill (sent its first token) before this one was sent;
capped at prompt_tokens - 1 (a request always computes at least one token) and rounded down to a
whole number of pages. Warmup requests fill the cache but are not counted in the rates.
"""

from __future__ import annotations

import bisect

from .records import PHASE_PROFILING, RequestRecord

DEFAULT_PAGE_SIZE = 16


def page_size_of(models_doc) -> int | None:
    """`data[0].flashlane.page_size` of a /v1/models document (flashlane servers), else None."""
    try:
        v = models_doc["data"][0]["flashlane"]["page_size"]
    except (KeyError, IndexError, TypeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def resolve_page_size(override: int | None, models_doc) -> tuple[int, str]:
    """(page size, where it came from): the override, the server's model card, or the default."""
    if override is not None:
        if override < 1:
            raise ValueError(f"page_size: must be >= 1, got {override}")
        return override, "override"
    served = page_size_of(models_doc)
    if served is not None:
        return served, "server /v1/models"
    return DEFAULT_PAGE_SIZE, "default"


def _history_tokens(rec: RequestRecord, by_id: dict[str, RequestRecord]) -> int:
    seen = set()
    j = by_id.get(rec.extends_request_id) if rec.extends_request_id else None
    while j is not None and j.request_id not in seen:
        if j.input_tokens is not None:
            fed = j.output_tokens - 1 if j.output_fed_back and j.output_tokens else 0
            return j.input_tokens + fed
        seen.add(j.request_id)
        j = by_id.get(j.extends_request_id) if j.extends_request_id else None
    return 0


def reusable_tokens(records: list[RequestRecord], page_size: int) -> dict[str, int]:
    """request_id -> theoretical reusable prefix tokens, for every request with a prompt count."""
    if page_size < 1:
        raise ValueError(f"page_size: must be >= 1, got {page_size}")
    by_id = {r.request_id: r for r in records}
    prefilled = sorted((r.first_token_time, r.shared_prefix_tokens) for r in records
                       if r.first_token_time is not None and r.shared_prefix_tokens > 0)
    times = [t for t, _ in prefilled]
    running_max, best = [], 0
    for _, n in prefilled:
        best = max(best, n)
        running_max.append(best)
    out = {}
    for r in records:
        if not r.input_tokens:
            continue
        reuse = _history_tokens(r, by_id)
        if r.shared_prefix_tokens > 0 and r.send_time is not None:
            k = bisect.bisect_right(times, r.send_time)
            if k:
                reuse = max(reuse, min(r.shared_prefix_tokens, running_max[k - 1]))
        reuse = max(0, min(reuse, r.input_tokens - 1))
        out[r.request_id] = reuse // page_size * page_size
    return out


def prefix_cache_rates(records: list[RequestRecord], page_size: int) -> dict:
    """Server-reported and theoretical hit rates over the completed profiled requests.

    `prefix_cache_hit_vs_theoretical` = server cached ÷ theoretical reusable tokens over the
    requests that report cached tokens: 1.0 = the server reused everything it could.
    """
    reuse = reusable_tokens(records, page_size)
    counted = [r for r in records if r.phase == PHASE_PROFILING and r.ok and r.input_tokens]
    reporting = [r for r in counted if r.cached_tokens is not None]
    prompt = sum(r.input_tokens for r in counted)
    theoretical = sum(reuse[r.request_id] for r in counted)
    rep_prompt = sum(r.input_tokens for r in reporting)
    rep_cached = sum(r.cached_tokens for r in reporting)
    rep_theoretical = sum(reuse[r.request_id] for r in reporting)
    return {
        "page_size": page_size,
        "prompt_tokens": prompt,
        "theoretical_reusable_tokens": theoretical,
        "cached_tokens": rep_cached if reporting else None,
        "prefix_cache_hit_rate": rep_cached / rep_prompt if reporting else None,
        "prefix_cache_hit_rate_theoretical": theoretical / prompt if prompt else None,
        "prefix_cache_hit_vs_theoretical": (rep_cached / rep_theoretical
                                            if reporting and rep_theoretical else None),
        "requests_reporting_cached_tokens": len(reporting),
    }
