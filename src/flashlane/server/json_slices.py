"""``json.loads`` of a large body in slices, for a worker thread.

``json.loads`` is one C call that holds the GIL for the whole document (measured: ~1 s for
30 MB of token ids), so the event loop stalls that long even when the parse runs on another
thread. Here the top-level object and the arrays and objects directly inside it are walked in
Python and each value below them is one ``raw_decode`` call (a prompt of <= max_model_len ids,
one message): between those calls the interpreter hands the GIL to the event loop. Anything
unusual (a byte-order mark, invalid JSON) is handed to ``json.loads`` itself, so the result
and every error are exactly what it gives.
"""

from __future__ import annotations

import json
import re

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")
SLICED_DEPTH = 2   # containers at depth 0 and 1 are walked; values at depth 2 are decoded whole


class _Unusual(Exception):
    pass


def loads_in_slices(body: bytes | bytearray | str):
    text = body if isinstance(body, str) else body.decode(json.detect_encoding(body), "surrogatepass")
    try:
        if text.startswith("\ufeff"):
            raise _Unusual
        value, end = _value(text, _SPACE.match(text, 0).end(), 0)
        if _SPACE.match(text, end).end() != len(text):
            raise _Unusual
        return value
    except (_Unusual, json.JSONDecodeError, IndexError):
        return json.loads(text)  # raises json.loads's own error (or parses what this walk could not)


def _value(s: str, i: int, depth: int):
    if depth < SLICED_DEPTH:
        c = s[i:i + 1]
        if c == "{":
            return _object(s, i + 1, depth)
        if c == "[":
            return _array(s, i + 1, depth)
    return _DECODER.raw_decode(s, i)


def _array(s: str, i: int, depth: int):
    items = []
    i = _SPACE.match(s, i).end()
    if s[i:i + 1] == "]":
        return items, i + 1
    while True:
        item, i = _value(s, i, depth + 1)
        items.append(item)
        i = _SPACE.match(s, i).end()
        c = s[i:i + 1]
        if c == "]":
            return items, i + 1
        if c != ",":
            raise _Unusual
        i = _SPACE.match(s, i + 1).end()


def _object(s: str, i: int, depth: int):
    obj = {}
    i = _SPACE.match(s, i).end()
    if s[i:i + 1] == "}":
        return obj, i + 1
    while True:
        if s[i:i + 1] != '"':
            raise _Unusual
        key, i = _DECODER.raw_decode(s, i)
        i = _SPACE.match(s, i).end()
        if s[i:i + 1] != ":":
            raise _Unusual
        obj[key], i = _value(s, _SPACE.match(s, i + 1).end(), depth + 1)
        i = _SPACE.match(s, i).end()
        c = s[i:i + 1]
        if c == "}":
            return obj, i + 1
        if c != ",":
            raise _Unusual
        i = _SPACE.match(s, i + 1).end()
