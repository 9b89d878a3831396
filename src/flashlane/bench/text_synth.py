"""Deterministic prompt text of a requested token length.

With the target's tokenizer (a `tokenizer.json`), text is built from vocabulary entries that are a
space followed by letters: byte-level BPE pre-tokenises on spaces, so a chain of such words
re-tokenises to exactly one token per word and the length is exact. Without a tokenizer we use
the documented approximation "one common short English word + space ~ one token", which holds for
GPT-2/Llama/Qwen/GLM-style vocabularies to within a few percent. Either way the metrics take
token counts from the server's `usage`, never from here.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Callable

# Short, very common words: single tokens in every mainstream BPE vocabulary.
FALLBACK_WORDS = (
    "the of and to in is was for on that with as by at from his he it an are be this which or "
    "had not but first one new were also after all who two their has its they time more other "
    "been into some only would may most when there over can many years such these about world "
    "then state city part where while during made under both team later three well known year "
    "used people each between them since her out through being work through high called age "
    "name school system south north west east game small large area long end life day house home "
    "book page line word note list case data file code test call step plan task tool read write "
    "run set get put add find make take give keep move open close start stop next last left right "
    "good best low fast slow big old full free main real true false null value key type class "
    "model user agent query path link text form view edit save load send build check fix"
).split()


class TextSynth:
    """Seeded filler text with a known token length. `key` makes equal requests byte-identical."""

    def __init__(self, seed: int = 0, tokenizer=None, words: list[str] | None = None):
        self.seed = seed
        self.tokenizer = tokenizer
        if words is not None:
            self.words = list(words)
        elif tokenizer is not None:
            self.words = single_token_words(tokenizer) or list(FALLBACK_WORDS)
        else:
            self.words = list(FALLBACK_WORDS)
        self.exact = tokenizer is not None and words is None and bool(single_token_words(tokenizer))
        self._cache: dict[tuple, str] = {}

    def text(self, n_tokens: int, *key) -> str:
        """Words each led by a space (so the first one is a single token too), about `n_tokens`
        tokens long (exact with a tokenizer)."""
        if n_tokens <= 0:
            return ""
        k = (n_tokens, *key)
        hit = self._cache.get(k)
        if hit is not None:
            return hit
        digest = hashlib.sha256(repr((self.seed, key)).encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "little"))
        words = self.words
        out = "".join(" " + words[rng.randrange(len(words))] for _ in range(n_tokens))
        if len(self._cache) < 4096:
            self._cache[k] = out
        return out

    def count(self, text: str) -> int:
        """Token count of `text`: tokenizer when known, else the word approximation."""
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return len(text.split())

    @staticmethod
    def nonce(*key) -> str:
        """Per-session-tree cache-bust marker (prefix of the first user message)."""
        return "[rid:" + hashlib.sha256(repr(key).encode()).hexdigest()[:12] + "]"


def single_token_words(tokenizer) -> list[str]:
    """Vocabulary entries that decode to ' <letters>' and re-encode to themselves."""
    cached = getattr(tokenizer, "_flashlane_words", None)
    if cached is not None:
        return cached
    vocab = tokenizer.get_vocab()
    cands = []
    for tok_id in sorted(vocab.values()):
        s = tokenizer.decode([tok_id])
        if len(s) >= 3 and s[0] == " " and s[1:].isascii() and s[1:].isalpha():
            cands.append((tok_id, s))
    if not cands:
        words: list[str] = []
    else:
        encs = tokenizer.encode_batch([s for _, s in cands], add_special_tokens=False)
        words = [s[1:] for (tok_id, s), enc in zip(cands, encs) if enc.ids == [tok_id]]
    try:
        tokenizer._flashlane_words = words
    except AttributeError:
        pass
    return words


# A name that is not a path -> a tokenizer.json or a folder holding one (None: unknown name).
TokenizerResolver = Callable[[str], "str | Path | None"]


def _tokenizer_file(spec: str | Path) -> Path | None:
    p = Path(spec).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    return p if p.is_file() else None


def load_tokenizer(spec: str | None, resolve: TokenizerResolver | None = None):
    """A `tokenizers.Tokenizer` from a tokenizer.json path or a HF folder holding one.

    The bench reads tokenizers by path only and imports nothing of flashlane's models or presets:
    a name that is not a path (e.g. a flashlane preset) is handed to `resolve`, the caller's
    name -> path mapping (the CLI passes one for presets). Returns None (approximation) when `spec`
    is None. Raises ValueError naming `tokenizer` when a given spec cannot be resolved.
    """
    if not spec:
        return None
    from tokenizers import Tokenizer

    p = _tokenizer_file(spec)
    if p is None and resolve is not None:
        try:
            found = resolve(spec)
        except (ValueError, OSError):
            found = None
        p = _tokenizer_file(found) if found else None
    if p is not None:
        return Tokenizer.from_file(str(p))
    raise ValueError(f"tokenizer: {spec!r} is neither a tokenizer.json nor a folder holding one"
                     + ("" if resolve is None else ", and names nothing the resolver knows"))
