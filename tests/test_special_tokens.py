"""skip_special_tokens / spaces_between_special_tokens (vLLM's meaning, both default true) in the
tokenizer, the incremental detokenizer, LLM.generate and over HTTP (issue 13, item 6): the tiny
presets' <|reserved_i|> tokens are special, so generated text drops them unless asked not to."""

from __future__ import annotations

import json

import httpx
import pytest

from flashlane import LLM, SamplingParams
from flashlane import presets
from flashlane.engine.detokenizer import IncrementalDetokenizer
from flashlane.models.tokenizer import Tokenizer

from engine_models import preset
from server_harness import ENGINE_ARGS, LiveServer

MODEL = "tiny-flash"
PROMPTS = ["The cache holds", "Hello", "def add(a, b):", "Once upon a time there was a"]
N = 24
OPTIONS = [dict(skip_special_tokens=s, spaces_between_special_tokens=b) for s in (True, False) for b in (True, False)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_folder(presets.write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def _reserved(tok, i):
    return tok.token_to_id(f"<|reserved_{i}|>")


def test_reserved_tokens_are_special_and_dropped_by_default(tok):
    hello = tok.encode("Hello world", add_special_tokens=False)
    r1, r2 = _reserved(tok, 1), _reserved(tok, 2)
    ids = hello[:1] + [r1] + hello[1:] + [r2]
    a, b = tok.decode(hello[:1]), tok.decode(hello[1:])
    assert a + b == "Hello world" and tok.decode(ids) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == f"{a}<|reserved_1|>{b}<|reserved_2|>"
    assert (tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True)
            == f"{a} <|reserved_1|> {b} <|reserved_2|>")
    # what is kept re-encodes to the same ids
    assert tok.encode(tok.decode(ids, skip_special_tokens=False), add_special_tokens=False) == ids


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: f"skip={o['skip_special_tokens']},"
                                                       f"spaces={o['spaces_between_special_tokens']}")
def test_incremental_detokenizer_equals_one_decode(tok, opts):
    text = "Déjà vu: 東京 ✓ and more"
    plain = tok.encode(text, add_special_tokens=False)
    ids = [_reserved(tok, 7)] + plain[:3] + [_reserved(tok, 8), 4] + plain[3:] + [_reserved(tok, 9)]
    detok = IncrementalDetokenizer(tok, **opts)
    streamed = "".join(detok.step(ids[:k], final=k == len(ids)) for k in range(1, len(ids) + 1))
    assert streamed == tok.decode(ids, **opts)
    assert ("<|reserved_" in streamed) != opts["skip_special_tokens"]


def test_a_tokenizer_that_rendered_a_template_can_be_copied_and_pickled(tok):
    import copy
    import pickle

    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages)          # compiles and keeps the jinja template
    for other in (copy.deepcopy(tok), pickle.loads(pickle.dumps(tok))):
        assert other.apply_chat_template(messages) == text
        assert other.encode("hello") == tok.encode("hello")


def test_sampling_params_fields_are_booleans():
    assert SamplingParams().skip_special_tokens and SamplingParams().spaces_between_special_tokens
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded, **ENGINE_ARGS)


def _special_ids(tokenizer) -> set[int]:
    return {i for i in range(tokenizer.vocab_size)
            if tokenizer.decode([i]) == "" and tokenizer.decode([i], skip_special_tokens=False)}


@pytest.fixture(scope="module")
def prompt(llm):
    """A prompt whose greedy output holds special tokens (random weights: most of them do)."""
    special = _special_ids(llm.tokenizer)
    for p in PROMPTS:
        out = llm.generate(p, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))[0]
        if any(t in special for t in out.token_ids):
            return p
    pytest.fail("no greedy output of the probe prompts holds a special token")


def _offline(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, **kw))[0]


def test_llm_drops_special_tokens_by_default_and_keeps_them_when_asked(llm, prompt):
    tok = llm.tokenizer
    default = _offline(llm, prompt)
    assert "<|reserved_" not in default.text and default.text == tok.decode(default.token_ids)
    kept = _offline(llm, prompt, skip_special_tokens=False)
    assert kept.token_ids == default.token_ids and "<|reserved_" in kept.text
    assert kept.text == tok.decode(kept.token_ids, skip_special_tokens=False, spaces_between_special_tokens=True)
    raw = _offline(llm, prompt, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert raw.text == tok.decode(raw.token_ids, skip_special_tokens=False)
    assert raw.text != kept.text and raw.text.replace(" ", "") == kept.text.replace(" ", "")


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(loaded, MODEL) as srv:
        yield srv


def _body(prompt, **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True, **kw}


def _streamed(c, path, body):
    parts = []
    with c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"]
                if choice:
                    parts.append(choice[0].get("text") or (choice[0].get("delta") or {}).get("content") or "")
    return "".join(parts)


def test_http_completions_and_chat_honour_skip_special_tokens(server, llm, prompt):
    with server.client() as c:
        default = c.post("/v1/completions", json=_body(prompt)).json()["choices"][0]["text"]
        assert "<|reserved_" not in default and default == _offline(llm, prompt).text
        body = _body(prompt, skip_special_tokens=False)
        kept = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert "<|reserved_" in kept and kept == _offline(llm, prompt, skip_special_tokens=False).text
        assert _streamed(c, "/v1/completions", body) == kept
        raw = c.post("/v1/completions", json={**body, "spaces_between_special_tokens": False}).json()
        assert raw["choices"][0]["text"] == _offline(llm, prompt, skip_special_tokens=False,
                                                     spaces_between_special_tokens=False).text
        # chat: the same switch; the assistant text is whatever the chat prompt makes the model say
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": N,
                "temperature": 0, "ignore_eos": True, "logprobs": True}
        r = c.post("/v1/chat/completions", json=chat).json()
        ids_text = [t["token"] for t in r["choices"][0]["logprobs"]["content"]]  # logprob tokens keep specials
        special = [t for t in ids_text if t.startswith("<|reserved_")]
        assert "<|reserved_" not in r["choices"][0]["message"]["content"]
        r2 = c.post("/v1/chat/completions", json={**chat, "skip_special_tokens": False}).json()
        content = r2["choices"][0]["message"]["content"]
        assert all(s in content for s in special)
        assert _streamed(c, "/v1/chat/completions", {**chat, "skip_special_tokens": False}) == content
        bad = c.post("/v1/completions", json=_body(prompt, skip_special_tokens="no"))
        assert bad.status_code == 400 and "skip_special_tokens" in bad.text


def test_http_400_names_a_bad_spaces_flag(server):
    r = httpx.post(server.url + "/v1/completions", json=_body("x", spaces_between_special_tokens=1), timeout=60)
    assert r.status_code == 400 and "spaces_between_special_tokens" in r.text
