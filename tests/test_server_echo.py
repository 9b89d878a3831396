"""echo, max_tokens 0 and prompt_logprobs on /v1/completions (what lm-eval's loglikelihood
requests send), checked number by number against LLM.score with the prefix cache on: a prompt
sent twice is a prefix-cache hit the second time, and still gets every position's logprob."""

from __future__ import annotations

import json

import pytest

from flashlane import LLM

from engine_models import preset
from server_harness import ENGINE_ARGS, LiveServer

MODEL = "tiny-flash"
TOL = 1e-4
# three full pages (page size 16) and a tail: a second send hits the cache on all three
TEXT = ("The quick brown fox jumps over the lazy dog while the cache keeps every page it has seen, "
        "and the scheduler packs prefill chunks with decode steps. Every request that asks for prompt "
        "logprobs computes its whole prompt again.")
LM_EVAL = {"max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}   # lm-eval's loglikelihood body


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(loaded, MODEL) as srv:   # the prefix cache is on (the engine's default)
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def score(loaded):
    """Token ids -> the logprob of each token after the first, from the plain engine path."""
    llm = LLM(loaded, **{**ENGINE_ARGS, "enable_prefix_caching": False})

    def run(ids: list[int]) -> list[float]:
        rows = llm.score([ids])[0]
        return [rows[i, t].item() for i, t in enumerate(ids[1:])]
    return run


def _ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode(text)


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= TOL


def _post(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_scores_every_prompt_token_also_on_a_prefix_cache_hit(client, loaded, score):
    ids = _ids(loaded, TEXT)
    assert len(ids) > 3 * 16
    want = score(ids)
    first, second = (_post(client, prompt=TEXT, **LM_EVAL) for _ in range(2))
    for resp in (first, second):
        (choice,) = resp["choices"]
        lp = choice["logprobs"]
        assert choice["text"].startswith(TEXT) and len(lp["tokens"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert _close(lp["token_logprobs"][1:len(ids)], want)
        assert "".join(lp["tokens"][:len(ids)]) == TEXT
        assert lp["text_offset"][:3] == [0, len(lp["tokens"][0]), len(lp["tokens"][0]) + len(lp["tokens"][1])]
        assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0   # it read nothing from the cache
    # what the scoring requests computed was cached for everyone else
    plain = _post(client, prompt=TEXT, max_tokens=1, temperature=0)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 16


def test_token_id_batch_with_n_echoes_each_prompt_in_every_choice(client, loaded, score):
    prompts = [_ids(loaded, TEXT)[:40], _ids(loaded, "def add(a, b): return a + b")]
    resp = _post(client, prompt=prompts, n=2, **{**LM_EVAL, "max_tokens": 3}, ignore_eos=True)
    choices = sorted(resp["choices"], key=lambda c: c["index"])
    assert len(choices) == 4
    for choice in choices:
        ids = prompts[choice["index"] // 2]
        prompt_text = loaded.tokenizer.decode(ids, skip_special_tokens=False)
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt_text) and len(lp["tokens"]) == len(ids) + 3
        assert _close(lp["token_logprobs"][1:len(ids)], score(ids))
    assert resp["usage"]["completion_tokens"] == 4 * 3


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(client, loaded, score):
    ids = _ids(loaded, TEXT)
    resp = _post(client, prompt=TEXT, **{**LM_EVAL, "max_tokens": 0, "logprobs": 2}, prompt_logprobs=3,
                 return_token_ids=True)
    (choice,) = resp["choices"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length" and choice["token_ids"] == []
    assert resp["usage"]["completion_tokens"] == 0 and resp["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and _close(lp["token_logprobs"][1:], score(ids))
    assert all(len(top) == 2 for top in lp["top_logprobs"][1:])
    # vLLM's prompt_logprobs: None, then {token id: {logprob, rank, decoded_token}}, the prompt token first
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tok, row, want in zip(ids[1:], plp[1:], score(ids)):
        first, *top = row.items()
        assert first[0] == str(tok) and abs(first[1]["logprob"] - want) <= TOL
        assert first[1]["decoded_token"] == loaded.tokenizer.decode([tok], skip_special_tokens=False)
        ranked = sorted(row.values(), key=lambda v: -v["logprob"])[:3]
        assert [v["rank"] for v in ranked] == [1, 2, 3]
        assert 3 <= len(row) <= 4


def test_prompt_logprobs_without_echo_leave_the_completion_as_it_is(client, loaded, score):
    ids = _ids(loaded, TEXT)
    plain = _post(client, prompt=TEXT, max_tokens=4, temperature=0, ignore_eos=True)["choices"][0]
    (choice,) = _post(client, prompt=TEXT, max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)["choices"]
    assert choice["text"] == plain["text"] and choice["logprobs"] is None
    assert _close([next(iter(r.values()))["logprob"] for r in choice["prompt_logprobs"][1:]], score(ids))


def _stream(client, **body) -> list[dict]:
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streamed_echo_puts_the_prompt_in_each_choices_first_chunk(client, loaded):
    body = {"prompt": [TEXT, "def add(a, b):"], **{**LM_EVAL, "max_tokens": 3}, "ignore_eos": True}
    full = {c["index"]: c for c in _post(client, **body)["choices"]}
    chunks = [c["choices"][0] for c in _stream(client, **body)]
    for index, prompt in enumerate(body["prompt"]):
        mine = [c for c in chunks if c["index"] == index]
        assert mine[0]["text"].startswith(prompt)
        assert len(mine[0]["logprobs"]["tokens"]) == len(_ids(loaded, prompt)) + 1
        assert "".join(c["text"] for c in mine) == full[index]["text"]
        tokens = [t for c in mine for t in c["logprobs"]["tokens"]]
        offsets = [o for c in mine for o in c["logprobs"]["text_offset"]]
        assert tokens == full[index]["logprobs"]["tokens"] and offsets == full[index]["logprobs"]["text_offset"]
        assert [lp for c in mine for lp in c["logprobs"]["token_logprobs"]][1:] == pytest.approx(
            full[index]["logprobs"]["token_logprobs"][1:], abs=TOL)

    (only,) = _stream(client, prompt=TEXT, **{**LM_EVAL, "max_tokens": 0})
    choice = only["choices"][0]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(_ids(loaded, TEXT))


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
])
def test_bad_echo_requests_are_400s_naming_the_field(client, body, param):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_engine_thread_also_scores_cached_prompts_in_full(loaded, score):
    """The module's server runs its engine in a process of its own (the default); this one on a
    thread of the server process."""
    ids = _ids(loaded, TEXT)
    with LiveServer(loaded, MODEL, transport="thread") as srv, srv.client() as c:
        for _ in range(2):
            resp = _post(c, prompt=ids, **{**LM_EVAL, "max_tokens": 0}, prompt_logprobs=0)
            lp = resp["choices"][0]["logprobs"]
            assert _close(lp["token_logprobs"][1:], score(ids))
            plp = resp["choices"][0]["prompt_logprobs"]
            assert _close([row[str(t)]["logprob"] for t, row in zip(ids[1:], plp[1:])], score(ids))
