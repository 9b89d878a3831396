"""Bad input gets the intended 4xx in OpenAI's error shape, never a 500, and the server keeps
serving; the API key guards everything but /health; oversized bodies get 413."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine_models import preset
from flashlane.engine.request_check import CONTEXT_EXCEEDED, InvalidRequest
from flashlane.server.errors import APIError
from flashlane.server.serving import engine_errors, stream_error
from server_harness import LiveServer, metric

MODEL = "tiny-flash"
MAX_LEN = 64
OK_C = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(loaded, MODEL, max_model_len=MAX_LEN, max_body_bytes=64 * 1024) as srv:
        yield srv


def c(**kw):
    return {**OK_C, **kw}


def chat(**kw):
    return {**OK_CHAT, **kw}


def without(body, key):
    return {k: v for k, v in body.items() if k != key}


# (id, method, path, json body or raw bytes, expected status, expected param or None)
CASES = [
    ("max_tokens_zero", "POST", CMPL, c(max_tokens=0), 400, "max_tokens"),
    ("max_tokens_negative", "POST", CHAT, chat(max_tokens=-5), 400, "max_tokens"),
    ("max_tokens_string", "POST", CMPL, c(max_tokens="ten"), 400, "max_tokens"),
    ("max_tokens_float", "POST", CMPL, c(max_tokens=2.5), 400, "max_tokens"),
    ("max_completion_tokens_zero", "POST", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("temperature_negative", "POST", CMPL, c(temperature=-0.1), 400, "temperature"),
    ("temperature_too_high", "POST", CHAT, chat(temperature=2.5), 400, "temperature"),
    ("temperature_bool", "POST", CMPL, c(temperature=True), 400, "temperature"),
    ("top_p_zero", "POST", CMPL, c(top_p=0), 400, "top_p"),
    ("top_p_above_one", "POST", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("top_k_below_minus_one", "POST", CMPL, c(top_k=-2), 400, "top_k"),
    ("min_p_above_one", "POST", CMPL, c(min_p=1.5), 400, "min_p"),
    ("n_zero", "POST", CMPL, c(n=0), 400, "n"),
    ("n_huge", "POST", CHAT, chat(n=10_000), 400, "n"),
    ("seed_too_big", "POST", CMPL, c(seed=2**70), 400, "seed"),
    ("stop_empty_string", "POST", CMPL, c(stop=[""]), 400, "stop.0"),
    ("stop_wrong_type", "POST", CHAT, chat(stop=5), 400, "stop"),
    ("logprobs_too_many", "POST", CMPL, c(logprobs=50), 400, "logprobs"),
    ("top_logprobs_too_many", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("stream_not_bool", "POST", CMPL, c(stream="yes"), 400, "stream"),
    ("stream_options_not_object", "POST", CHAT, chat(stream=True, stream_options="x"), 400, "stream_options"),
    ("prompt_missing", "POST", CMPL, without(OK_C, "prompt"), 400, "prompt"),
    ("prompt_empty", "POST", CMPL, c(prompt=""), 400, "prompt"),
    ("prompt_empty_list", "POST", CMPL, c(prompt=[]), 400, "prompt"),
    ("prompt_mixed_list", "POST", CMPL, c(prompt=[1, "a"]), 400, "prompt"),
    ("prompt_negative_token", "POST", CMPL, c(prompt=[5, -1]), 400, "prompt"),
    ("prompt_token_outside_vocab", "POST", CMPL, c(prompt=[5, 10**6]), 400, "prompt"),
    ("prompt_longer_than_context", "POST", CMPL, c(prompt=[7] * MAX_LEN), 400, "prompt"),
    ("long_text_prompt_tokenized_off_loop", "POST", CMPL, c(prompt="word " * 5000), 400, "prompt"),
    ("chat_longer_than_context", "POST", CHAT, chat(messages=[{"role": "user", "content": "word " * 200}]),
     400, "messages"),
    ("messages_missing", "POST", CHAT, without(OK_CHAT, "messages"), 400, "messages"),
    ("messages_empty", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("messages_not_list", "POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("message_bad_role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    ("message_image_part", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages.0.content.0.type"),
    ("max_tokens_0_without_echo", "POST", CMPL, c(max_tokens=0), 400, "max_tokens"),
    ("penalty_unsupported", "POST", CHAT, chat(presence_penalty=1.0), 400, "presence_penalty"),
    ("logit_bias_unsupported", "POST", CMPL, c(logit_bias={"5": 10}), 400, "logit_bias"),
    ("logit_bias_not_object", "POST", CHAT, chat(logit_bias=[1]), 400, "logit_bias"),
    ("best_of_not_n", "POST", CMPL, c(best_of=3), 400, "best_of"),
    ("invalid_json", "POST", CMPL, b'{"model": "tiny-flash", "prompt": ', 400, None),
    ("nan_temperature", "POST", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("body_is_array", "POST", CHAT, b"[1, 2, 3]", 400, None),
    ("empty_body", "POST", CMPL, b"", 400, None),
    ("unknown_model", "POST", CMPL, c(model="gpt-17"), 404, "model"),
    ("unknown_model_chat", "POST", CHAT, chat(model="nope"), 404, "model"),
    ("unknown_path", "POST", "/v1/embeddings", c(), 404, None),
    ("wrong_method", "GET", CMPL, None, 405, None),
    ("oversized_body", "POST", CMPL, c(prompt="x" * 100_000), 413, None),
]


@pytest.mark.parametrize("case", CASES, ids=[x[0] for x in CASES])
def test_bad_request_gets_intended_error(server, case):
    _, method, path, body, status, param = case
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.request(method, server.url + path, timeout=60, **({} if body is None else kw))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param or err["param"].startswith(param + "."), err


def test_server_is_healthy_after_the_table(server):
    for case in CASES:
        test_bad_request_gets_intended_error(server, case)
    m = server.wait_idle()
    assert not any('status="5' in k for k in m)  # no 5xx counted, ever
    assert metric(m, "flashlane:http_requests_total", status="400") >= 40
    r = httpx.post(server.url + CHAT, json=OK_CHAT, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_context_errors_say_context_length_exceeded(server):
    r = httpx.post(server.url + CMPL, json=c(prompt=[7] * MAX_LEN), timeout=60)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert str(MAX_LEN) in r.json()["error"]["message"]


def test_max_tokens_beyond_context_is_refused_not_capped(server):
    r = httpx.post(server.url + CMPL, json=c(prompt=[7] * (MAX_LEN - 3), max_tokens=1000, ignore_eos=True), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"maximum context length is {MAX_LEN} tokens" in err["message"]
    assert f"you requested {MAX_LEN - 3 + 1000} tokens ({MAX_LEN - 3} in the prompt, 1000 in the completion)" \
        in err["message"]
    # without max_tokens the completion gets what fits (at most the endpoint's default of 16)
    r = httpx.post(server.url + CMPL, json=without(c(prompt=[7] * (MAX_LEN - 3), ignore_eos=True), "max_tokens"),
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_refusal_by_the_engine_itself_keeps_its_param_and_code():
    """What the engine refuses at add time (past the server's own checks) is the same 400, before
    the 200 (engine_errors) and in a stream after it (stream_error)."""
    refusal = InvalidRequest("the prompt has 9 tokens; ...", "prompt", CONTEXT_EXCEEDED)
    with pytest.raises(APIError) as e, engine_errors():
        raise refusal
    assert (e.value.status, e.value.message, e.value.param, e.value.code) == (400, refusal.message, "prompt",
                                                                              CONTEXT_EXCEEDED)
    event, done = stream_error(refusal).split("\n\n")[:2]
    assert json.loads(event.removeprefix("data: "))["error"] == {
        "message": refusal.message, "type": "invalid_request_error", "param": "prompt", "code": CONTEXT_EXCEEDED}
    assert done == "data: [DONE]"


def test_chunked_oversized_body_is_413(server):
    def parts():
        for _ in range(40):
            yield b"x" * 4096

    r = httpx.post(server.url + CMPL, content=parts(), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_api_key_guards_everything_but_health(loaded):
    with LiveServer(loaded, MODEL, api_key="sekret", max_model_len=MAX_LEN) as srv:
        u = srv.url
        assert httpx.get(u + "/health").status_code == 200
        for method, path, body in [("GET", "/v1/models", None), ("GET", "/metrics", None),
                                   ("GET", "/openapi.json", None), ("POST", CMPL, OK_C), ("POST", CHAT, OK_CHAT),
                                   ("GET", "/nonexistent", None)]:
            for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}]:
                r = httpx.request(method, u + path, json=body, headers=headers, timeout=60)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        good = {"Authorization": "Bearer sekret"}
        assert httpx.get(u + "/v1/models", headers=good).status_code == 200
        assert httpx.get(u + "/metrics", headers={"x-api-key": "sekret"}).status_code == 200
        assert httpx.post(u + CMPL, json=OK_C, headers=good, timeout=60).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=u + "/v1", api_key="wrong", max_retries=0).models.list()
        oc = openai.OpenAI(base_url=u + "/v1", api_key="sekret", max_retries=0)
        assert oc.chat.completions.create(**OK_CHAT).choices[0].message.content is not None


def test_openai_client_raises_typed_errors(server):
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        oc.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
