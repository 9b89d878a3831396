"""The prefix cache as a client sees it: usage.prompt_tokens_details.cached_tokens (completions,
chat, streaming), Prometheus counters, idle pools with cached pages reported apart, bad flags."""

from __future__ import annotations

import json

import pytest

from flashlane.cli.main import build_parser

from engine_models import preset
from server_harness import LiveServer, metric

PAGE = 16


def _stream_usage(client, path: str, body: dict) -> dict:
    usage = None
    with client.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
    return usage


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard"])
def test_cached_tokens_reported_and_counted(name):
    with LiveServer(preset(name), served_model_name=name) as srv, srv.client() as c:
        prompt = "The quick brown fox jumps over the lazy dog. " * 12
        body = {"model": name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        first = c.post("/v1/completions", json=body).json()
        second = c.post("/v1/completions", json=body).json()
        n = first["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= n - PAGE
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        streamed = _stream_usage(c, "/v1/completions", body)
        assert streamed["prompt_tokens_details"]["cached_tokens"] >= n - PAGE

        messages = [{"role": "system", "content": prompt}, {"role": "user", "content": "Say something."}]
        chat = {"model": name, "messages": messages, "max_tokens": 4, "temperature": 0}
        c.post("/v1/chat/completions", json=chat)
        again = c.post("/v1/chat/completions", json=chat).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - PAGE
        chat_streamed = _stream_usage(c, "/v1/chat/completions", chat)
        assert chat_streamed["prompt_tokens_details"]["cached_tokens"] >= again["usage"]["prompt_tokens"] - PAGE

        m = srv.wait_idle()
        assert metric(m, "flashlane:cache_pages_used") == 0 and metric(m, "flashlane:state_slots_used") == 0
        assert metric(m, "flashlane:cache_pages_cached") > 0
        hits = metric(m, "flashlane:prefix_cache_hits_total")
        assert hits == metric(m, "flashlane:prefix_cache_hits_by_tier_total", tier="pool") > 0
        assert metric(m, "flashlane:prefix_cache_queries_total") >= hits
        card = c.get("/v1/models").json()["data"][0]["flashlane"]
        assert card["prefix_caching"] is True and card["page_size"] == PAGE
        if name == "tiny-flash":
            assert metric(m, "flashlane:prefix_cache_checkpoint_restores_total") > 0
            assert card["num_checkpoints"] > 0 and card["bytes_per_checkpoint"] == card["bytes_per_slot"]


def test_prefix_cache_can_be_turned_off():
    with LiveServer(preset("tiny-standard"), served_model_name="s", enable_prefix_caching=False) as srv, \
            srv.client() as c:
        body = {"model": "s", "prompt": "hello world " * 30, "max_tokens": 2}
        for _ in range(2):
            r = c.post("/v1/completions", json=body).json()
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(srv.wait_idle(), "flashlane:prefix_cache_hits_total") == 0


@pytest.mark.parametrize("argv,flag", [
    (["--checkpoint-share", "0"], "--checkpoint-share"),
    (["--checkpoint-share", "1.01"], "--checkpoint-share"),
    (["--checkpoint-share", "half"], "--checkpoint-share"),
    (["--host-cache-memory", "-1"], "--host-cache-memory"),
    (["--host-cache-memory", "lots"], "--host-cache-memory"),
    (["--disk-cache-bytes", "0"], "--disk-cache-bytes"),
    (["--disk-cache-bytes", "-3G"], "--disk-cache-bytes"),
    (["--disk-cache-dir", "/proc/version/cache"], "--disk-cache-dir"),
])
def test_bad_cache_flags_are_refused_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser("serve").parse_args(["serve", "--model", "tiny-flash", *argv])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_cache_flags_parse():
    args = build_parser("serve").parse_args(
        ["serve", "--model", "m", "--no-enable-prefix-caching", "--host-cache-memory", "2G",
         "--checkpoint-share", "0.25"])
    assert args.enable_prefix_caching is False and args.host_cache_memory == 2 << 30
    assert args.checkpoint_share == 0.25
    assert build_parser("serve").parse_args(["serve", "--model", "m"]).enable_prefix_caching is True


def test_disk_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    from flashlane import LLM
    with pytest.raises(ValueError, match="disk_cache_dir"):
        LLM(preset("tiny-flash"), dtype="float32", disk_cache_dir=str(f))
