"""Issue 21's small ones: client-supplied names echoed in errors are clipped, HEAD answers on every
GET route, the OpenAPI schema refuses what the server refuses, and `serve --max-tokens-default`."""

from __future__ import annotations

import jsonschema_rs
import pytest

from engine_models import preset
from flashlane.cli.main import main
from flashlane.engine.launch import engine_in_thread
from flashlane.server.app import create_app
from server_harness import ENGINE_ARGS, LiveServer

MODEL = "tiny-flash"
CAP = 5


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(loaded, MODEL, max_tokens_default=CAP) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


# ---- echoed names ---------------------------------------------------------------------------------

def test_a_huge_model_name_is_not_echoed_whole(client):
    name = "m" * 2_000_000
    r = client.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404
    assert len(r.content) < 2_000, len(r.content)
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "..." in err["message"] and "2000000 characters" in err["message"]


def test_a_short_model_name_is_echoed_as_given(client):
    r = client.post("/v1/completions", json={"model": "other-model", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404 and "'other-model'" in r.json()["error"]["message"]


def test_a_huge_dict_key_in_a_field_path_is_clipped(client):
    key = "k" * 100_000
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "logit_bias": {key: "not a number"}})
    assert r.status_code == 400
    assert len(r.content) < 2_000, len(r.content)
    assert r.json()["error"]["param"].startswith("logit_bias.kkk")


# ---- HEAD -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/health", "/debug/steps"])
def test_head_answers_like_get_without_a_body(client, path):
    get = client.get(path)
    head = client.head(path)
    assert head.status_code == get.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


def test_the_added_head_routes_stay_out_of_the_openapi_schema(client):
    paths = client.get("/openapi.json").json()["paths"]
    heads = [p for p, ops in paths.items() if "head" in ops]
    assert heads == ["/health"]  # its own, documented route
    assert "get" in paths["/v1/models"] and "get" in paths["/metrics"]


# ---- the schema says what the server accepts ------------------------------------------------------

def _validator(client, model: str) -> jsonschema_rs.Draft202012Validator:
    doc = client.get("/openapi.json").json()
    return jsonschema_rs.Draft202012Validator({"$ref": f"#/components/schemas/{model}",
                                               "components": doc["components"]})


REFUSED = [({"logit_bias": {"50256": -100}}, "logit_bias"), ({"presence_penalty": 0.5}, "presence_penalty"),
           ({"frequency_penalty": -1.0}, "frequency_penalty"), ({"min_tokens": 4}, "min_tokens"),
           ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"use_beam_search": 0}, "use_beam_search"),
           ({"guided_json": {"type": "object"}}, "guided_json"), ({"structured_outputs": {}}, "structured_outputs")]
REFUSED_COMPLETIONS = [({"suffix": "tail"}, "suffix")]
REFUSED_CHAT = [({"echo": True}, "echo"), ({"chat_template": "{{ messages }}"}, "chat_template"),
                ({"add_generation_prompt": False}, "add_generation_prompt"), ({"audio": {"voice": "x"}}, "audio"),
                ({"prompt_logprobs": 1}, "prompt_logprobs")]
ACCEPTED = [{"logit_bias": {}}, {"logit_bias": None}, {"presence_penalty": 0.0}, {"frequency_penalty": 0},
            {"repetition_penalty": 1}, {"min_tokens": 0}, {"use_beam_search": False}, {"store": True}]
ACCEPTED_COMPLETIONS = [{"echo": False}, {"suffix": ""}, {"suffix": None}, {"best_of": 1}]
ACCEPTED_CHAT = [{"add_generation_prompt": True}, {"echo": False}, {"chat_template_kwargs": None}]


@pytest.mark.parametrize("extra,param", REFUSED + REFUSED_COMPLETIONS)
def test_completion_fields_the_server_refuses_the_schema_refuses(client, extra, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, **extra}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert not _validator(client, "CompletionRequest").is_valid(body)


@pytest.mark.parametrize("extra", ACCEPTED + ACCEPTED_COMPLETIONS)
def test_completion_values_the_server_accepts_the_schema_accepts(client, extra):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, **extra}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert _validator(client, "CompletionRequest").is_valid(body)


@pytest.mark.parametrize("extra,param", REFUSED + REFUSED_CHAT)
def test_chat_fields_the_server_refuses_the_schema_refuses(client, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert "not supported" in r.json()["error"]["message"]
    assert not _validator(client, "ChatCompletionRequest").is_valid(body)


@pytest.mark.parametrize("extra", ACCEPTED + ACCEPTED_CHAT)
def test_chat_values_the_server_accepts_the_schema_accepts(client, extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert _validator(client, "ChatCompletionRequest").is_valid(body)


def test_best_of_documents_that_it_must_equal_n(client):
    props = client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "equal to n" in props["best_of"]["description"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


# ---- --max-tokens-default -------------------------------------------------------------------------

def test_a_completion_without_max_tokens_stops_at_the_server_default(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == CAP


def test_a_chat_without_max_tokens_stops_at_the_server_default(client):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == CAP


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_request_that_names_its_max_tokens_keeps_it(client, field):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "temperature": 0, "ignore_eos": True, field: CAP + 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == CAP + 3


@pytest.mark.parametrize("value", ["0", "-3"])
def test_serve_refuses_a_max_tokens_default_below_one_naming_the_flag(capsys, value):
    # checked before the model is loaded: a model that does not exist is never looked at
    assert main(["serve", "--model", "no-such-model", "--max-tokens-default", value]) == 2
    err = capsys.readouterr().err
    assert "--max-tokens-default must be >= 1" in err and "no-such-model" not in err


def test_create_app_refuses_a_max_tokens_default_below_one(loaded):
    engine = engine_in_thread(loaded, **ENGINE_ARGS)
    try:
        with pytest.raises(ValueError, match="max_tokens_default must be >= 1"):
            create_app(engine, MODEL, max_tokens_default=0)
    finally:
        engine.shutdown()
