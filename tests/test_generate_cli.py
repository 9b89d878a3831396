"""`flashlane generate` renders --prompt text with the model's chat template unless told
--no-chat, and says on stderr which it did."""

from __future__ import annotations

import json

import pytest

import flashlane.engine.llm as llm_module
from flashlane import LLM, presets
from flashlane.cli.main import main

SMALL = ["--dtype", "float32", "--cache-memory", str(32 << 20), "--max-model-len", "256", "--num-threads", "1"]
USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-flash", dtype="float32", cache_memory=32 << 20, max_model_len=256)


@pytest.fixture
def sent(tiny, monkeypatch):
    """The prompts `generate` hands to LLM.generate, from one shared tiny-flash engine."""
    prompts = []
    real = tiny.generate

    def spy(batch, params):
        prompts.extend(batch)
        return real(batch, params)

    monkeypatch.setattr(tiny, "generate", spy)
    monkeypatch.setattr(llm_module, "LLM", lambda model, **kwargs: tiny)
    return prompts


def generate(capsys, *flags: str) -> tuple[list[dict], str]:
    assert main(["generate", "--model", "tiny-flash", "--prompt", "hi", "--max-tokens", "2", "--ignore-eos",
                 "--json", *SMALL, *flags]) == 0
    out = capsys.readouterr()
    return [json.loads(line) for line in out.out.splitlines()], out.err


def test_chat_is_the_default_for_a_model_with_its_own_template(tiny, sent, capsys):
    assert tiny.tokenizer.has_own_chat_template
    rendered = tiny.tokenizer.apply_chat_template(USER_HI)
    (row,), err = generate(capsys)
    assert sent == [rendered] and row["prompt"] == "hi" and len(row["token_ids"]) == 2
    assert "prompt: rendered with the model's chat template (--no-chat for raw text)" in err.splitlines()
    generate(capsys, "--chat")
    assert sent == [rendered, rendered]


def test_no_chat_sends_the_raw_text(sent, capsys):
    _, err = generate(capsys, "--no-chat")
    assert sent == ["hi"] and "prompt: raw text (--no-chat)" in err.splitlines()


def test_without_a_template_of_its_own_raw_text_unless_chat_is_asked_for(tiny, sent, capsys, monkeypatch):
    monkeypatch.setattr(tiny.tokenizer, "has_own_chat_template", False)
    _, err = generate(capsys)
    assert sent == ["hi"] and "raw text (the model has no chat template of its own" in err
    _, err = generate(capsys, "--chat")
    assert sent == ["hi", tiny.tokenizer.apply_chat_template(USER_HI)]
    assert "prompt: rendered with the generic chat template (--chat)" in err.splitlines()


def test_explicit_chat_with_no_tokenizer_is_refused(capsys):
    assert main(["generate", "--model", "tiny-flash", "--skip-tokenizer-init", "--prompt-token-ids", "1,2",
                 "--chat"]) == 2
    assert "no --chat" in capsys.readouterr().err


def test_smollm2_answers_the_first_question_of_a_new_user(capsys):
    """The case that printed nothing: the instruct model fed raw text ended at once (token 2)."""
    try:
        presets.smollm2_gguf_path()
    except presets.PresetError as exc:   # the GGUF package is optional
        pytest.skip(str(exc))
    assert main(["generate", "--model", "smollm2-135m", "--prompt", "What is the capital of France?",
                 "--max-tokens", "8", "--json", *SMALL]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "Paris" in row["text"]
