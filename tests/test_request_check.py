"""The one request check (engine/request_check.py): every refusal is an InvalidRequest naming the
parameter at fault and, where OpenAI has one, its error code; the engine refuses with it on
every add."""

from __future__ import annotations

import pytest

from flashlane.engine.llm_engine import LLMEngine
from flashlane.engine.request_check import (CONTEXT_EXCEEDED, InvalidRequest, check_prompt_ids, check_sampling,
                                            resolve_max_tokens)
from flashlane.engine.sampling_params import SamplingParams, StructuredOutput

from engine_models import tiny_llama

VOCAB, MAX_LEN = 100, 32


def _refusal(fn, *args, **kwargs) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        fn(*args, **kwargs)
    assert isinstance(e.value, ValueError) and str(e.value) == e.value.message
    return e.value


@pytest.mark.parametrize("ids, why, code", [
    ([], "the prompt is empty", None),
    ([5, VOCAB], f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})", None),
    ([-1, 5], f"token id -1 is outside the vocabulary [0, {VOCAB})", None),
    ([5, float(VOCAB)], "prompt token ids must be integers", None),
    (list(range(MAX_LEN)), f"the prompt has {MAX_LEN} tokens; this model's maximum context length is {MAX_LEN}",
     CONTEXT_EXCEEDED),
])
def test_prompt_refusals_name_the_param_and_code(ids, why, code):
    for param in ("prompt", "messages"):
        e = _refusal(check_prompt_ids, ids, VOCAB, MAX_LEN, param)
        assert e.message.startswith(why) and (e.param, e.code) == (param, code)
    check_prompt_ids(list(range(MAX_LEN - 1)), VOCAB, MAX_LEN)   # room for one generated token


def test_max_tokens_is_refused_not_clamped():
    assert resolve_max_tokens(10, None, MAX_LEN) == MAX_LEN - 10
    assert resolve_max_tokens(10, MAX_LEN - 10, MAX_LEN) == MAX_LEN - 10
    e = _refusal(resolve_max_tokens, 10, MAX_LEN - 9, MAX_LEN, "max_completion_tokens", "messages")
    assert (e.param, e.code) == ("max_completion_tokens", CONTEXT_EXCEEDED)
    assert e.message == (f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
                         f"{MAX_LEN + 1} tokens (10 in the messages, {MAX_LEN - 9} in the completion). Please "
                         "reduce the length of the messages or 'max_completion_tokens'.")


def test_what_needs_a_tokenizer_is_refused_without_one():
    stop = SamplingParams(stop=["x"])
    structured = SamplingParams(structured=StructuredOutput(json_object=True))
    assert _refusal(check_sampling, stop, False).param == "stop"
    assert _refusal(check_sampling, structured, False).param == "response_format"
    check_sampling(stop, True)
    check_sampling(structured, True)
    check_sampling(SamplingParams(stop_token_ids=[3]), False)


def test_the_engine_refuses_with_the_same_check_and_keeps_nothing():
    engine = LLMEngine(tiny_llama(), dtype="float32", cache_memory=8 << 20, max_model_len=MAX_LEN)
    vocab = engine.config.vocab_size
    for ids, params, param, code in [
        ([5, vocab], SamplingParams(), "prompt", None),
        (list(range(3, 3 + MAX_LEN)), SamplingParams(), "prompt", CONTEXT_EXCEEDED),
        ([5, 6], SamplingParams(max_tokens=MAX_LEN), "max_tokens", CONTEXT_EXCEEDED),
    ]:
        e = _refusal(engine.add_request, "r", ids, params)
        assert (e.param, e.code) == (param, code)
    assert not engine.requests and not engine.has_unfinished()
    engine.add_request("r", [5, 6], SamplingParams(max_tokens=2))
    assert _refusal(engine.add_request, "r", [5, 6], SamplingParams()).param == "request_id"
    no_tokenizer = LLMEngine(tiny_llama(), dtype="float32", cache_memory=8 << 20, skip_tokenizer_init=True)
    assert _refusal(no_tokenizer.add_request, "t", "text", SamplingParams()).param == "prompt"
    assert _refusal(no_tokenizer.add_request, "s", [5, 6], SamplingParams(stop=["x"])).param == "stop"


@pytest.mark.parametrize("ids", [[5, 2.5, 7], [5, "x"], [5, None], [True, 3]])
def test_prompt_ids_that_are_not_integers_are_refused(ids):
    with pytest.raises(InvalidRequest, match="must be integers") as e:
        check_prompt_ids(ids, vocab_size=100, max_model_len=64, param="prompt")
    assert e.value.param == "prompt"


def test_an_int64_array_prompt_is_checked_like_a_list():
    from array import array
    check_prompt_ids(array("q", [1, 2, 3]), vocab_size=100, max_model_len=64)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        check_prompt_ids(array("q", [1, 200]), vocab_size=100, max_model_len=64)
