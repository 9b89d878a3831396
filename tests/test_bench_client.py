"""The streaming client against the in-test fake server: timing fields, usage, error classes."""

import asyncio

import httpx
import pytest

from flashlane.bench.client import Target, classify_http_error, send_request
from flashlane.bench.records import RequestRecord
from flashlane.bench.server_launch import free_port


def send(url, messages, max_tokens=8, ignore_eos=True, endpoint="chat", model="fake-model",
         keep_text=False, timeout=30.0):
    rec = RequestRecord(request_id="r", session_id="s", tree_id="t", requested_input_tokens=5)

    async def go():
        async with httpx.AsyncClient() as client:
            return await send_request(client, Target(url, model, endpoint, request_timeout_s=timeout),
                                      messages, max_tokens, ignore_eos, rec, keep_text)

    text = asyncio.run(go())
    return rec, text


MSG = [{"role": "system", "content": "sys a b c"}, {"role": "user", "content": "hello there"}]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_streamed_request_record(fake_server, endpoint):
    fake_server.cfg.ttft_s = 0.05
    fake_server.cfg.token_delay_s = 0.01
    rec, text = send(fake_server.url, MSG, max_tokens=6, endpoint=endpoint, keep_text=True)
    assert rec.ok and rec.error_class is None and rec.http_status == 200
    assert rec.send_time < rec.first_token_time <= rec.last_token_time <= rec.end_time
    # the server sleeps ttft_s after the request was sent (asyncio may wake a clock tick early)
    assert rec.first_token_time - rec.send_time >= 0.05 - 1e-3
    assert (rec.input_tokens, rec.output_tokens, rec.usage_reported) == (6, 6, True)
    assert rec.num_chunks == 6 and len(rec.chunk_gaps_s) == 5
    # Chunks can arrive coalesced under load (a late first chunk shrinks the spread of the gaps,
    # so their sum has no lower bound), but the last one never before the server sent it:
    # ttft + 5 token delays after the request went out.
    assert all(g >= 0 for g in rec.chunk_gaps_s)
    assert rec.last_token_time - rec.send_time >= 0.05 + 5 * 0.01 - 1e-3
    assert sum(rec.chunk_gaps_s) == pytest.approx(rec.last_token_time - rec.first_token_time, abs=1e-4)
    assert rec.finish_reason == "length" and rec.output_text == text and len(text.split()) == 6
    body = fake_server.state.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 6
    assert ("messages" in body) == (endpoint == "chat")


def test_cached_tokens_from_usage_details(fake_server):
    send(fake_server.url, MSG)
    rec, _ = send(fake_server.url, MSG + [{"role": "user", "content": "more words"}])
    assert rec.cached_tokens == 6 and rec.input_tokens == 8


def test_multi_token_chunks_give_token_normalised_gaps(fake_server):
    fake_server.cfg.tokens_per_chunk = 4
    fake_server.cfg.token_delay_s = 0.02
    rec, _ = send(fake_server.url, MSG, max_tokens=16)
    assert rec.num_chunks == 4 and rec.output_tokens == 16
    # each gap is divided by the 4 tokens its chunk carried: 3 gaps of ~0.02 s -> ~0.005 s each
    assert sum(rec.chunk_gaps_s) == pytest.approx((rec.last_token_time - rec.first_token_time) / 4, abs=1e-4)
    # (no lower bound on the sum: a late first chunk shrinks it) the last chunk comes >= 3 delays in
    assert all(g >= 0 for g in rec.chunk_gaps_s)
    assert rec.last_token_time - rec.send_time >= 3 * 0.02 - 1e-3


def test_missing_usage_falls_back_to_chunk_count_and_is_flagged(fake_server):
    fake_server.cfg.report_usage = False
    rec, _ = send(fake_server.url, MSG, max_tokens=5)
    assert rec.ok and not rec.usage_reported and rec.output_tokens == 5 and rec.input_tokens == 5


@pytest.mark.parametrize("setup, cls, status", [
    (lambda c: setattr(c, "error_every", 1), "http_5xx", 500),
    (lambda c: setattr(c, "max_model_len", 3), "context_overflow", 400),
    (lambda c: setattr(c, "midstream_error_every", 1), "stream_error", 200),
])
def test_errors_are_classified(fake_server, setup, cls, status):
    setup(fake_server.cfg)
    rec, text = send(fake_server.url, MSG, max_tokens=8)
    assert not rec.ok and rec.error_class == cls and rec.http_status == status and text == ""
    assert rec.end_time >= rec.send_time and rec.error_message


def test_wrong_model_connection_refused_and_timeout(fake_server):
    rec, _ = send(fake_server.url, MSG, model="other")
    assert rec.error_class == "http_4xx" and rec.http_status == 404
    rec, _ = send(f"http://127.0.0.1:{free_port()}", MSG)
    assert rec.error_class == "connection"
    fake_server.cfg.ttft_s = 1.0
    rec, _ = send(fake_server.url, MSG, timeout=0.2)
    assert rec.error_class == "timeout"


def test_classify_http_error_and_target_validation():
    assert classify_http_error(400, "prompt is too long for this model") == "context_overflow"
    assert classify_http_error(400, "bad temperature") == "http_4xx"
    assert classify_http_error(429, "") == "http_429"
    assert classify_http_error(503, "") == "http_5xx"
    assert Target("http://h:1/v1/", "m").url == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError, match="endpoint"):
        Target("http://h", "m", "embeddings")


def test_empty_text_chunks_mid_stream_count_as_tokens():
    """A stream whose tokens all decode to nothing (skipped special tokens) still has tokens;
    the chat role chunk and a bare finish chunk do not."""
    from flashlane.bench.client import _carries_tokens

    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    empty_chat = {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]}
    empty_text = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    usage_only = {"choices": [], "usage": {"completion_tokens": 3}}
    assert not _carries_tokens(role) and not _carries_tokens(finish) and not _carries_tokens(usage_only)
    assert _carries_tokens(empty_chat) and _carries_tokens(empty_text)
    assert _carries_tokens({"choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]})
