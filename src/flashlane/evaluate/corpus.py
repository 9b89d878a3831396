"""The evaluation text and its perplexity windows.

Default corpus: the English documentation that ships with Python (``pydoc_data.topics``), the
topics joined in sorted key order, so every machine with the same Python reads the same text."""

from __future__ import annotations

import json
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".ndjson")


def default_corpus() -> tuple[str, str]:
    """(name, text) of the Python documentation topics."""
    import sys

    from pydoc_data.topics import topics

    version = ".".join(map(str, sys.version_info[:3]))
    return f"pydoc_data.topics (Python {version})", "\n\n".join(topics[k] for k in sorted(topics))


def read_corpus(path: str | Path) -> tuple[str, str]:
    """(name, text) of a plain-text file, or of a JSONL file (``.jsonl`` / ``.ndjson``) whose every
    line is an object with a string ``text`` field (the texts joined by blank lines)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--corpus {path}: no such file")
    raw = path.read_text(encoding="utf-8")
    if path.suffix.lower() not in JSONL_SUFFIXES:
        return str(path), raw
    texts = []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--corpus {path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f"--corpus {path}:{lineno}: a JSONL line needs a string 'text' field")
        texts.append(obj["text"])
    return str(path), "\n\n".join(texts)


def make_windows(token_ids: list[int], window: int, max_windows: int | None = None) -> list[list[int]]:
    """Consecutive non-overlapping windows of ``window`` tokens (a partial last one is dropped),
    at most ``max_windows`` of them."""
    if window < 2:
        raise ValueError(f"--window must be >= 2 tokens, got {window}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"--max-windows must be >= 1, got {max_windows}")
    count = len(token_ids) // window
    if count == 0:
        raise ValueError(f"the corpus has {len(token_ids)} tokens, shorter than one window of {window} "
                         "(--window): give a longer --corpus or a smaller --window")
    if max_windows is not None:
        count = min(count, max_windows)
    return [token_ids[i * window: (i + 1) * window] for i in range(count)]
