"""The official openai client against `flashlane serve` (real HTTP, tiny-flash): completions,
chat, streaming, logprobs, n, stops, usage, /v1/models, /metrics — checked against LLM.generate."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from flashlane import LLM, SamplingParams

from engine_models import preset
from server_harness import ENGINE_ARGS, LiveServer, metric

MODEL = "tiny-flash"
PROMPTS = ["The cache holds", "Once upon a time there was a", "def add(a, b):"]


@pytest.fixture(scope="module")
def loaded():
    return preset(MODEL)


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(loaded, MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded, **ENGINE_ARGS)


def _greedy(llm, prompt, n=10, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw))[0]


def test_completion_equals_llm_generate(client, llm):
    for p in PROMPTS:
        ref = _greedy(llm, p)
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.object == "text_completion" and r.model == MODEL
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == 10
        assert r.usage.total_tokens == r.usage.prompt_tokens + 10
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_text_equals_non_streamed_greedy(client):
    for p in PROMPTS:
        full = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
        chunks = list(client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == full.choices[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        assert all(c.usage is None for c in chunks[:-1])


def test_chat_uses_the_template_and_streams_the_same_text(client, llm, loaded):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    ref = _greedy(llm, loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True), 12)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 12


def test_content_parts_and_developer_role(client, llm, loaded):
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ref = _greedy(llm, loaded.tokenizer.apply_chat_template(plain, add_generation_prompt=True), 6)
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.text


def test_token_id_prompts_batch_and_n(client, llm):
    ids = [[17, 401, 9, 2200, 5], [3000, 12, 12, 77]]
    r = client.completions.create(model=MODEL, prompt=ids, n=2, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text == _greedy(llm, ids[c.index // 2], 5).text
    assert r.usage.prompt_tokens == 9 and r.usage.completion_tokens == 20
    texts = ["alpha beta", "gamma"]
    r = client.completions.create(model=MODEL, prompt=texts, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [_greedy(llm, t, 4).text for t in texts]


def test_streaming_n_interleaves_choices(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    texts = {i: "" for i in range(3)}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2}
    assert texts[0] == texts[1] == texts[2] != ""  # greedy: every choice the same


def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL, prompt="Seeds make", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"top_k": 50, "min_p": 0.01, "ignore_eos": True})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    many = client.completions.create(**{**kw, "n": 4})
    assert many.choices[0].text == a  # choice i samples with seed + i
    assert len({c.text for c in many.choices}) > 1


def test_completion_logprobs_match_llm(client, llm):
    ref = _greedy(llm, "Logprobs of", 5, logprobs=3)
    r = client.completions.create(model=MODEL, prompt="Logprobs of", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for j, (tok, entry) in enumerate(zip(ref.token_ids, ref.logprobs)):
        assert math.isclose(lp.token_logprobs[j], entry[tok], abs_tol=1e-4)
        assert len(lp.top_logprobs[j]) <= 3
        assert max(lp.top_logprobs[j].values()) == pytest.approx(lp.token_logprobs[j], abs=1e-4)  # greedy
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = list(client.completions.create(model=MODEL, prompt="Logprobs of", max_tokens=5, temperature=0,
                                              logprobs=3, stream=True, extra_body={"ignore_eos": True}))
    s_lp = [x for c in streamed for x in c.choices[0].logprobs.token_logprobs]
    assert s_lp == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(item.bytes).decode(errors="replace") == item.token


def test_stop_string_ends_the_text(client, llm):
    ref = _greedy(llm, PROMPTS[1], 16).text
    cut = next(i for i in range(3, len(ref)) if ref[i].strip())  # a visible character a few chars in
    stop = ref[cut:cut + 2]
    want = ref[:ref.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                              stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == want


def test_models_card_reports_the_cache(client, server):
    cards = client.models.list().data
    assert [c.id for c in cards] == [MODEL]
    raw = httpx.get(server.url + "/v1/models").json()["data"][0]
    report = raw["flashlane"]
    assert raw["max_model_len"] == ENGINE_ARGS["max_model_len"]
    assert report["arch"] == "glm5_next"
    assert report["cache_bytes_per_token"] == report["latent_bytes_per_token"] + report["index_bytes_per_token"] > 0
    assert report["state_bytes_per_sequence"] == report["bytes_per_slot"] > 0
    for key in ("num_pages", "num_state_slots", "max_running", "page_size"):
        assert report[key] > 0


def test_metrics_count_requests_tokens_and_latency(client, server, loaded):
    before = server.metrics()
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    after = server.wait_idle()

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("flashlane:request_success_total", finished_reason="length") == 1
    assert delta("flashlane:generation_tokens_total") == 3
    assert delta("flashlane:prompt_tokens_total") == len(loaded.tokenizer.encode("count me"))
    assert delta("flashlane:time_to_first_token_seconds_count") == 1
    assert delta("flashlane:inter_token_latency_seconds_count") == 2
    assert delta("flashlane:e2e_request_latency_seconds_count") == 1
    assert delta("flashlane:http_requests_total", status="200") >= 1
    assert metric(after, "flashlane:cache_pages_free") > 0
    assert metric(after, "flashlane:state_slots_free") == server.engine.info.num_state_slots
    assert metric(after, "flashlane:num_preemptions_total") == 0
