"""Structured output (``SamplingParams.structured``): the generated text must follow a JSON
schema, or be any JSON object, enforced token by token with llguidance.

Per engine, ``Grammars`` turns flashlane's tokenizer into llguidance's (once, on the first
constrained request: ~0.3 s for a 49K vocabulary) and compiles each distinct schema once (an LRU
keyed by the schema's text; each request gets a copy of the compiled matcher, which shares the
grammar). Per request, a ``GrammarMatcher`` follows the tokens committed to the request. Before
sampling, ``Grammars.mask`` sets every token the grammar forbids at that point to -inf; the
mask spans the logits' width, so ids past the tokenizer's vocabulary are never allowed, and EOS
is allowed only where the document may end. The request finishes ("stop") once the grammar is
complete.

JSON is generated compact (``", "`` and ``": "`` separators, no other whitespace): with
flexible whitespace a model can emit newlines forever and never reach the end of the document.

Why llguidance, measured on a 2-core CPU (``benchmarks/structured_output.py``): it has no
dependencies (a 3 MB wheel; xgrammar needs transformers, and triton, a 286 MB wheel, at run
time), it reads the ``tokenizers`` JSON flashlane already holds, it compiles a schema in ~1-2 ms
(outlines-core builds a DFA over the whole vocabulary: 0.8 s for a mid-size schema at 49K
tokens), its mask costs ~0.1-0.25 ms per row and step (xgrammar's is faster, but both are well
under 1% of a decode step here), and ``GrammarMatcher.rollback`` takes back tokens (rejected
speculative drafts).
"""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np
import torch

from .sampling_params import StructuredOutput

JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


def _llguidance():
    import llguidance  # imported on first use: engines that never constrain output never load it

    return llguidance


class SchemaError(ValueError):
    """A JSON schema that cannot be enforced; ``reason`` says why (the server names its own field)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"SamplingParams.structured.json_schema {reason}")
        self.reason = reason

    def __reduce__(self):   # it crosses from the engine-core process to the server by pickle
        return SchemaError, (self.reason,)


def schema_text(structured: StructuredOutput) -> str:
    """The constraint's JSON schema as canonical ASCII text (key order kept: it is the order the
    properties are generated in): the cache key, and what llguidance compiles."""
    schema = ANY_OBJECT if structured.json_object else structured.json_schema
    try:
        if isinstance(schema, str):
            schema = json.loads(schema)
        return json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"is not JSON: {exc}") from None


def _llguidance_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with llguidance's failures as a ``SchemaError``: a ValueError for
    bad input, or pyo3's PanicException (a BaseException) where its Rust code panics, which must
    not take the engine loop down."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:
        raise SchemaError(f"is not a usable JSON schema: {exc}") from None


def grammar_text(structured: StructuredOutput) -> str:
    """llguidance's grammar for the constraint, validated without a tokenizer (cheap: well under
    a millisecond for a mid-size schema); a bad schema is a ``SchemaError``."""
    matcher = _llguidance().LLMatcher
    grammar = _llguidance_call(matcher.grammar_from_json_schema, schema_text(structured), defaults=JSON_FORMAT)
    error = _llguidance_call(matcher.validate_grammar, grammar, None)
    if error:
        raise SchemaError(f"cannot be enforced: {error}")
    return grammar


class GrammarMatcher:
    """One request's position in its grammar. Only tokens committed to the request are fed to
    it (never again on a preemption's recompute)."""

    def __init__(self, matcher) -> None:
        self.inner = matcher                 # llguidance.LLMatcher

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False (and an error state) when the grammar forbids it."""
        return self.inner.consume_token(token)

    @property
    def finished(self) -> bool:
        """The document is complete (or the matcher failed): no token but EOS may follow."""
        return self.inner.is_stopped()

    @property
    def error(self) -> str | None:
        return self.inner.get_error() if self.inner.is_error() else None

    def rollback(self, num_tokens: int) -> None:
        """Take back the last ``num_tokens`` accepted tokens (speculative decoding's rejected drafts)."""
        if not self.inner.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.inner.get_error()}")


class Grammars:
    """The engine's grammar side: compiled schemas for its tokenizer, and the logits mask."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256) -> None:
        self.tokenizer = tokenizer           # flashlane's Tokenizer (None: token ids only)
        self.vocab_size = vocab_size         # the logits' width, may exceed the tokenizer's vocabulary
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._compiled: OrderedDict[str, object] = OrderedDict()   # schema text -> pristine matcher
        self._lltokenizer = None
        self._executor = None

    def _tokenizer(self):
        if self._lltokenizer is None:
            backend = getattr(self.tokenizer, "backend", None)
            if backend is None:
                raise ValueError("SamplingParams.structured needs the model's tokenizer and this engine has none "
                                 "(skip_tokenizer_init=True, or a tokenizer that is not a `tokenizers` one)")
            llg = _llguidance()
            self._lltokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                eos_token=self.eos_token_ids or None)
        return self._lltokenizer

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for a new request; ValueError naming the field for a bad schema."""
        tokenizer = self._tokenizer()
        key = schema_text(structured)
        pristine = self._compiled.get(key)
        if pristine is None:
            pristine = _llguidance_call(_llguidance().LLMatcher, tokenizer, grammar_text(structured), log_level=0)
            if pristine.is_error():
                raise SchemaError(f"cannot be enforced: {pristine.get_error()}")
            self._compiled[key] = pristine
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return GrammarMatcher(pristine.deep_copy())

    def mask(self, logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> None:
        """Set the logits each row's grammar forbids to -inf, in place (rows without one: untouched)."""
        rows = [j for j, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        words = (self.vocab_size + 31) // 32
        bitmask = torch.empty(len(rows), words, dtype=torch.int32)
        if len(rows) == 1:
            matchers[rows[0]].inner.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        else:
            if self._executor is None:
                self._executor = _llguidance().LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(matchers[j].inner, i) for i, j in enumerate(rows)],
                                                   bitmask.data_ptr(), words * 4, len(rows))
        # bit t % 32 of word t // 32 allows token t: little-endian bytes, little bit order
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
        forbidden = ~torch.from_numpy(allowed.view(np.bool_))   # unpackbits gives 0/1 bytes
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            index = torch.tensor(rows, dtype=torch.long)
            logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
