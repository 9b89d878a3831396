"""A checkpoint without tokenizer.json, served as token ids (issue 13, item 7): vLLM's
``skip_tokenizer_init`` on LLM, `flashlane generate` and `flashlane serve`; text prompts and chat
get a clear error."""

from __future__ import annotations

import json

import pytest

from flashlane import LLM, SamplingParams
from flashlane.cli.main import build_parser, main
from flashlane.cli.make_tiny import make_tiny
from flashlane.models.loader import LoadError

from server_harness import ENGINE_ARGS, LiveServer

PROMPT = [5, 17, 99, 256, 1000]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = make_tiny("llama", tmp_path_factory.mktemp("ids") / "tiny-llama", seed=3)
    (out / "tokenizer.json").unlink()
    return out


def test_a_folder_without_a_tokenizer_names_the_option(folder):
    with pytest.raises(LoadError, match="skip_tokenizer_init=True"):
        LLM(str(folder), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), skip_tokenizer_init=True, **ENGINE_ARGS)


def test_llm_takes_and_gives_token_ids(llm):
    assert llm.tokenizer is None
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.text == "" and out.prompt_token_ids == PROMPT
    again = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert again.token_ids == out.token_ids
    with pytest.raises(ValueError, match="token ids"):
        llm.generate("a text prompt", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, stop=["x"]))


def test_skip_tokenizer_init_ignores_a_tokenizer_that_is_there(tmp_path):
    folder = make_tiny("llama", tmp_path / "with-tok", seed=3)
    llm = LLM(str(folder), skip_tokenizer_init=True, **ENGINE_ARGS)
    assert llm.tokenizer is None
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0))[0].text == ""


def test_generate_cli_with_token_ids(folder, capsys):
    argv = ["generate", "--model", str(folder), "--skip-tokenizer-init", "--prompt-token-ids", "5,17,99",
            "--max-tokens", "4", "--ignore-eos", "--json", "--dtype", "float32", "--cache-memory", str(32 << 20),
            "--max-model-len", "256"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["prompt"] == [5, 17, 99] and len(out["token_ids"]) == 4 and out["text"] == ""
    assert main(["generate", "--model", str(folder), "--skip-tokenizer-init", "--prompt", "hi"]) == 2
    assert "--prompt-token-ids" in capsys.readouterr().err


def test_serve_accepts_the_flag():
    args = build_parser("serve").parse_args(["serve", "--model", "m", "--skip-tokenizer-init"])
    from flashlane.cli.engine_flags import engine_kwargs
    assert engine_kwargs(args)["skip_tokenizer_init"] is True


def test_http_token_ids_in_and_out_and_400_for_text(folder, llm):
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    with LiveServer(str(folder), "ids", skip_tokenizer_init=True) as srv, srv.client() as c:
        body = {"model": "ids", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = c.post("/v1/completions", json={**body, "logprobs": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == ref.token_ids and choice["text"] == ""
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
        streamed = []
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed += json.loads(line[6:])["choices"][0].get("token_ids") or []
        assert streamed == ref.token_ids
        text = c.post("/v1/completions", json={**body, "prompt": "some text"})
        assert text.status_code == 400 and "token ids" in text.json()["error"]["message"]
        assert text.json()["error"]["param"] == "prompt"
        chat = c.post("/v1/chat/completions", json={"model": "ids", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400 and "tokenizer" in chat.json()["error"]["message"]
        stop = c.post("/v1/completions", json={**body, "stop": ["x"]})
        assert stop.status_code == 400 and stop.json()["error"]["param"] == "stop"
