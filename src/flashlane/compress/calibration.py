"""Calibration text, token windows, and a plain (no-engine) forward of a flashlane model.

The default corpus is the English documentation text that ships with Python
(``pydoc_data.topics``); ``--corpus FILE`` takes plain text or JSONL with a ``text`` field.
Calibration and distillation windows are cut from the END of the tokenised corpus, so they do
not overlap the first windows a perplexity evaluation scores from its start.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..cache_spec import cache_spec
from ..engine.cache.pools import allocate_pools
from ..models.forward_batch import ForwardBatch

PAGE_SIZE = 16


def corpus_text(path: str | Path | None = None) -> str:
    """The calibration corpus: ``path`` (plain text, or ``.jsonl`` with a ``text`` field per line)
    or, by default, Python's own documentation topics."""
    if path is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--corpus {path} does not exist")
    raw = path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl":
        return raw
    texts = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            texts.append(str(json.loads(line)["text"]))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"--corpus {path}:{n}: expected a JSON object with a 'text' field ({exc})") from exc
    return "\n\n".join(texts)


def tail_windows(ids: list[int], seq_len: int, count: int) -> list[list[int]]:
    """``count`` consecutive non-overlapping windows of ``seq_len`` tokens ending at the corpus end."""
    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2, got {seq_len}")
    if count < 1 or len(ids) < seq_len * count:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than {count} window(s) of {seq_len} "
                         "(lower --calibration-tokens / --seq-len or give a longer --corpus)")
    start = len(ids) - seq_len * count
    return [ids[start + i * seq_len:start + (i + 1) * seq_len] for i in range(count)]


def corpus_windows(tokenizer, corpus: str | Path | None, seq_len: int, count: int) -> list[list[int]]:
    if tokenizer is None:
        raise ValueError("the model has no tokenizer, so the calibration corpus cannot be tokenised")
    return tail_windows(tokenizer.encode(corpus_text(corpus), add_special_tokens=False), seq_len, count)


def forward_logits(model, cfg, windows: list[list[int]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Prefill every window from an empty cache in one batch: logits [len(windows), L, V] (fp32).
    The model's forward hooks (calibration statistics) fire as in serving."""
    if not windows or len({len(w) for w in windows}) != 1:
        raise ValueError("forward_logits needs one or more windows of one length")
    spec = cache_spec(cfg, PAGE_SIZE)
    pages = [-(-len(w) // PAGE_SIZE) for w in windows]
    cache = allocate_pools(spec, 1 + sum(pages), 1 + len(windows), dtype, next(model.parameters()).device)
    tables, first = [], 1
    for p in pages:
        tables.append(list(range(first, first + p)))
        first += p
    slots = [b + 1 if spec.needs_state_slot else 0 for b in range(len(windows))]
    batch = ForwardBatch.build(windows, [0] * len(windows), tables, slots, cache)
    with torch.no_grad():
        logits = model.compute_logits(model(batch)).float()
    return logits.view(len(windows), len(windows[0]), -1)
