"""Refuse what cannot fit before paying for it: bounds checked on the parsed JSON body, before
validation, chat rendering and tokenisation.

What a request costs before the engine sees it (parsing, validation, rendering, tokenising) grows
with the body, while what the model can use is bounded by its context length. So:

- sequences per request (prompts x ``n``) and chat messages are counted first, before any of
  them is looked at (2,000,000 one-character prompts are one ``len``);
- a text longer than ``max_prompt_chars`` cannot fit: no token of the vocabulary covers more
  than ``chars_per_token`` characters, so such a text has more tokens than the context holds;
- every string must be valid Unicode (a JSON ``"\\udc80"`` escape decodes to a lone surrogate,
  which no tokenizer or JSON encoder accepts).
- a large body is parsed in a child first, and its JSON values are counted per field: the prompt
  may hold as many as its sequences' tokens, the messages a few per message, and all other
  fields together (the ones the schema bounds, like ``stop``, and the ones it ignores, like
  ``logit_bias`` or ``tools``) at most ``OTHER_VALUES``. Parsing costs about 1 us a value in this
  process, with the GIL held: 2 M ``logit_bias`` entries were a 1.9 s stall before this bound.

This module is stdlib-only on purpose: run as a script (``python -I -S body_limits.py LIMITS
KIND < body``) it does the same checks in a child process, so parsing a very large body can
neither hold this process's GIL nor grow its heap.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass

DEFAULT_MAX_SEQS_PER_REQUEST = 1024
OTHER_VALUES = 1 << 16      # JSON values outside 'prompt' and 'messages' (parsed: ~60 ms at most)
VALUES_PER_MESSAGE = 32     # a message with a few tool calls holds ~20

# normalizers that never merge input characters (so one token still covers <= its own length)
_EXPANDING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
# canonical composition merges at most a base character and three marks into one (e.g. U+1FAF)
_COMPOSING_NORMALIZERS = {"NFC": 4, "NFKC": 4}
# pre-tokenizers that keep every character (others, like Whitespace, drop some)
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


@dataclass(frozen=True)
class BodyLimits:
    max_model_len: int
    chars_per_token: int | None      # no token covers more input characters (None: unknown tokenizer)
    max_seqs: int                    # prompts x n in one request
    max_messages: int                # chat messages (and text parts) in one request

    @property
    def max_prompt_values(self) -> int:
        """JSON values a servable 'prompt' can hold: a full context of token ids per sequence."""
        return self.max_seqs * (self.max_model_len + 1) + 1

    @property
    def max_message_values(self) -> int:
        return VALUES_PER_MESSAGE * self.max_messages + 1

    @property
    def max_prompt_chars(self) -> int | None:
        """The longest text that can still fit (prompt plus one generated token)."""
        return None if self.chars_per_token is None else (self.max_model_len - 1) * self.chars_per_token

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class Refusal(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def as_list(self) -> list:
        return [self.status, self.message, self.param, self.code]


# ---- the bound from the tokenizer -------------------------------------------------------------

def chars_per_token(tokenizer) -> int | None:
    """The most input characters one token can stand for, from the vocabulary's longest entry;
    None when it cannot be known (no inspectable vocabulary, a normalizer or pre-tokenizer that
    drops characters, an unknown token that swallows whole words)."""
    backend = getattr(tokenizer, "backend", None)
    try:
        vocab = backend.get_vocab(with_added_tokens=True)
        spec = json.loads(backend.to_str())
    except Exception:  # not a `tokenizers` tokenizer (or an unreadable one): no bound
        return None
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _keeps_characters(spec.get("pre_tokenizer")) or not _unknowns_are_short(spec):
        return None
    # raw vocabulary strings: for byte-level BPE one character per byte (>= the characters it
    # covers), for SentencePiece-style models the piece itself (byte-fallback pieces overcount)
    longest = max((len(t) for t in vocab), default=0)
    return max(1, longest) * factor


def _normalizer_factor(spec) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _EXPANDING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _COMPOSING_NORMALIZERS[kind]
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content", "")
        if pattern is None or not content:  # a regex, or a deletion
            return None
        return max(1, -(-len(pattern) // len(content)))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, ...: may drop characters


def _keeps_characters(spec) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(p) for p in spec.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _unknowns_are_short(spec) -> bool:
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return False  # WordPiece / WordLevel / Unigram map a whole unknown word to one token
    return model.get("byte_fallback") or not (model.get("unk_token") and model.get("fuse_unk"))


# ---- the checks -------------------------------------------------------------------------------

def check_body(data, limits: BodyLimits, kind: str, count_values: bool = False) -> None:
    """Raise Refusal for a body that cannot be served; anything else (wrong types, missing
    fields) is left to the schema. ``kind``: "completions" or "chat"."""
    if not isinstance(data, dict):
        if count_values:  # only a child refuses: the parent lets the schema say what is wrong
            raise Refusal(400, "the request body must be a JSON object")
        return
    n = data.get("n", 1)
    n = n if type(n) is int and n >= 1 else 1
    if kind == "chat":
        _check_messages(data.get("messages"), limits)
        _check_seqs(1, n, limits, "n")
    else:
        _check_prompts(data.get("prompt"), n, limits)
    if count_values:
        _check_value_count(data, limits)
    where = _find_surrogate(data, "")
    if where is not None:
        path, char = where
        raise Refusal(400, f"'{path}' is not valid Unicode text: it holds a lone surrogate (U+{ord(char):04X}); "
                           "send UTF-8 text, or escape characters outside the BMP as a surrogate pair",
                      path or None)


def _check_seqs(count: int, n: int, limits: BodyLimits, param: str) -> None:
    if count * n > limits.max_seqs:
        what = f"{count} prompts x n={n}" if count > 1 else f"n={n}"
        raise Refusal(400, f"this request asks for {count * n} sequences ({what}); the server accepts at most "
                           f"{limits.max_seqs} per request", param)


def _check_prompts(prompt, n: int, limits: BodyLimits) -> None:
    if isinstance(prompt, str):
        check_text(len(prompt), "prompt", "the prompt", limits)
    elif isinstance(prompt, list) and prompt:
        if _is_int(prompt[0]):
            _check_ids(prompt, "prompt", limits)
            _check_seqs(1, n, limits, "n")
            return
        _check_seqs(len(prompt), n, limits, "prompt" if len(prompt) > limits.max_seqs else "n")
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                check_text(len(item), f"prompt.{i}", f"prompt {i}", limits)
            elif isinstance(item, list):
                _check_ids(item, f"prompt.{i}", limits)
    else:
        _check_seqs(1, n, limits, "n")


def check_text(chars: int, param: str, what: str, limits: BodyLimits) -> None:
    bound = limits.max_prompt_chars
    if bound is not None and chars > bound:
        raise Refusal(400, f"{what} has {chars} characters; this model's maximum context length is "
                           f"{limits.max_model_len} tokens and none of its tokens covers more than "
                           f"{limits.chars_per_token} characters, so at most {bound} characters can fit",
                      param, "context_length_exceeded")


def _check_ids(ids: list, param: str, limits: BodyLimits) -> None:
    if len(ids) >= limits.max_model_len:
        raise Refusal(400, f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                           f"{limits.max_model_len} tokens (prompt plus at least one generated token)",
                      param, "context_length_exceeded")


def _check_messages(messages, limits: BodyLimits) -> None:
    if not isinstance(messages, list):
        return
    if len(messages) > limits.max_messages:
        raise Refusal(400, f"'messages' holds {len(messages)} messages; at most {limits.max_messages} fit this "
                           f"model's maximum context length of {limits.max_model_len} tokens (each message "
                           "takes at least one token)", "messages", "context_length_exceeded")
    chars = parts = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            parts += len(content)
            if parts > limits.max_messages:
                raise Refusal(400, f"the messages hold more than {limits.max_messages} content parts; that many "
                                   f"cannot fit this model's maximum context length of {limits.max_model_len} "
                                   "tokens", "messages", "context_length_exceeded")
            chars += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    check_text(chars, "messages", "the messages' content", limits)


def _check_value_count(data: dict, limits: BodyLimits) -> None:
    """More JSON values than any servable request holds (a huge ignored field, 3 M stop ids):
    counted per field, so that one field's budget cannot be spent by another."""
    other, biggest = 0, (0, None)
    for key, value in data.items():
        if key == "prompt":
            _count_values(value, limits.max_prompt_values, "prompt",
                          f"at most {limits.max_seqs} sequences of {limits.max_model_len} token ids")
        elif key == "messages":
            _count_values(value, limits.max_message_values, "messages",
                          f"at most {limits.max_messages} messages of {VALUES_PER_MESSAGE} values")
        else:
            n = _count_values(value, OTHER_VALUES, None, None)  # in full (to the budget): names the biggest
            other += n + 1  # the key
            biggest = max(biggest, (n, key))
            if other > OTHER_VALUES:
                field = _printable(biggest[1])
                raise Refusal(413, f"the request's fields other than 'prompt' and 'messages' hold more than "
                                   f"{OTHER_VALUES} JSON values ('{field}' the most); no field this server reads "
                                   "needs that many", field, "request_too_large")


def _count_values(v, limit: int, param: str | None, servable: str | None) -> int:
    """The JSON values (keys included) in ``v``; past ``limit`` a Refusal naming ``param``
    (or, with no param, a count one past the limit, for the caller to refuse)."""
    count, stack = 0, [v]
    while stack:
        v = stack.pop()
        count += 1
        if isinstance(v, dict):
            stack.extend(v.values())
            count += len(v)
        elif isinstance(v, list):
            if _only_scalars(v):  # e.g. a prompt's token ids: counted without visiting each
                count += len(v)
            else:
                stack.extend(v)
        if count > limit:
            if param is None:
                return limit + 1
            raise Refusal(413, f"'{param}' holds more than {limit} JSON values, more than a servable request "
                               f"holds ({servable})", param, "request_too_large")
    return count


_SURROGATE = re.compile("[\ud800-\udfff]")


def _find_surrogate(v, path: str):
    """(path, character) of the first string (value or key) holding a lone surrogate, or None."""
    if isinstance(v, str):
        if not v.isascii():
            m = _SURROGATE.search(v)
            if m:
                return path, m.group()
        return None
    if isinstance(v, dict):
        for k, item in v.items():
            sub = f"{path}.{_printable(k)}" if path else _printable(k)
            if isinstance(k, str) and not k.isascii() and _SURROGATE.search(k):
                return sub, _SURROGATE.search(k).group()
            found = _find_surrogate(item, sub)
            if found:
                return found
    elif isinstance(v, list) and not _only_scalars(v):
        for i, item in enumerate(v):
            found = _find_surrogate(item, f"{path}.{i}" if path else str(i))
            if found:
                return found
    return None


_SCALARS = frozenset({int, float, bool, type(None)})


def _only_scalars(items: list) -> bool:
    """No strings or containers among ``items`` (one pass in C, not a Python loop)."""
    return set(map(type, items)) <= _SCALARS


def _printable(s) -> str:
    return str(s).encode("utf-8", "backslashreplace").decode("utf-8")


def _is_int(v) -> bool:
    return type(v) is int


# ---- the child process ------------------------------------------------------------------------

CHILD_NICENESS = 10


def _main(argv: list[str]) -> int:
    # refusing a body is worth less than serving: where cores are few, the scheduler runs the
    # server (and its clients) first and this parse in the time left over
    try:
        os.nice(CHILD_NICENESS)
    except (AttributeError, OSError):  # no nice() here
        pass
    limits, kind = BodyLimits(**json.loads(argv[1])), argv[2]
    body = sys.stdin.buffer.read()
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        out = {"json_error": [exc.msg, exc.pos]}
    except ValueError:  # not UTF-8 (or -16/-32) at all
        out = {"unreadable": True}
    else:
        try:
            check_body(data, limits, kind, count_values=True)
            out = {"ok": True}
        except Refusal as r:
            out = {"refusal": r.as_list()}
    sys.stdout.write(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
