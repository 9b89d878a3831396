"""/tokenize, /detokenize and /tokenizer_info in vLLM's shapes (tiny-flash), and their 400s: bad
token ids, neither or both of prompt and messages, a server without a tokenizer."""

from __future__ import annotations

import pytest

from flashlane.server.chat import render_chat
from flashlane.server.protocol import ChatMessage

from engine_models import preset
from server_harness import LiveServer

MODEL = "tiny-flash"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


@pytest.fixture(scope="module")
def client(loaded):
    with LiveServer(loaded, MODEL) as srv, srv.client() as c:
        yield c


def test_tokenize_a_prompt(client, loaded):
    tok = loaded.tokenizer
    r = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world, hello cache"})
    assert r.status_code == 200, r.text
    ids = tok.encode("Hello world, hello cache")
    assert r.json() == {"count": len(ids), "max_model_len": 512, "tokens": ids}
    strs = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True,
                                          "add_special_tokens": False}).json()
    assert strs["token_strs"] == [tok.id_to_token(t) for t in strs["tokens"]]


def test_tokenize_messages_is_what_chat_completions_feeds_the_model(client, loaded):
    tok = loaded.tokenizer
    got = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert got == tok.encode(render_chat(tok, [ChatMessage(**m) for m in MESSAGES]))
    chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(got)
    bare = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert bare == tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=False))
    assert got[:len(bare)] == bare and len(got) > len(bare)


def test_detokenize_round_trips(client, loaded):
    ids = loaded.tokenizer.encode("Once upon a time <|endoftext|>")
    r = client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "Once upon a time <|endoftext|>"}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_tokenizer_info_has_what_lm_eval_reads(client, loaded):
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == loaded.tokenizer.eos_token and "bos_token" in info and "pad_token" in info
    assert info["chat_template"] == loaded.tokenizer.chat_template and info["model_max_length"] == 512
    head = client.head("/tokenizer_info")
    assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [5, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [5, -1]}, "tokens.1"),
    ("/detokenize", {"tokens": "5"}, "tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
])
def test_bad_bodies_are_400s_naming_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unknown_model_is_a_404(client):
    r = client.post("/tokenize", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_a_server_without_a_tokenizer_says_so(loaded):
    with LiveServer(loaded, MODEL, skip_tokenizer_init=True) as srv, srv.client() as c:
        for method, path, body, param in [("POST", "/tokenize", {"prompt": "hi"}, "prompt"),
                                          ("POST", "/detokenize", {"tokens": [5]}, "tokens"),
                                          ("GET", "/tokenizer_info", None, None)]:
            r = c.request(method, path, json=body)
            assert r.status_code == 400, r.text
            assert "no tokenizer" in r.json()["error"]["message"] and r.json()["error"]["param"] == param
