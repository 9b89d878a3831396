"""One streaming request to an OpenAI-compatible server, timed on the bench clock.

Fills a RequestRecord in place: send / first token / last token / end times, token counts from
the server's `usage` (client-side chunk counting only as a flagged fallback), cached tokens,
token-normalised chunk gaps, and a status with an error class. Never raises for a failed request:
errors are data.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field

import httpx

from .clock import now
from .records import STATUS_ERROR, STATUS_OK, RequestRecord

OVERFLOW_RE = re.compile(
    r"context length|context window|maximum context|prompt is too long|too many tokens|"
    r"exceeds the max|max_model_len|maximum model length", re.I)


@dataclass
class Target:
    base_url: str
    model: str
    endpoint: str = "chat"  # "chat" | "completions"
    temperature: float | None = None
    request_timeout_s: float = 600.0

    def __post_init__(self):
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint: expected 'chat' or 'completions', got {self.endpoint!r}")
        self.base_url = self.base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url + path


def build_body(target: Target, messages: list[dict], max_tokens: int, ignore_eos: bool) -> dict:
    body: dict = {"model": target.model, "max_tokens": max_tokens, "stream": True,
                  "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if target.temperature is not None:
        body["temperature"] = target.temperature
    if target.endpoint == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = completion_prompt(messages)
    return body


def completion_prompt(messages: list[dict]) -> str:
    """The message array as one `/v1/completions` prompt: messages separated by a blank line,
    except that an assistant message follows its prompt directly, where the model wrote it, so
    the next prompt starts with the previous prompt plus its output, token for token."""
    out = ""
    for m in messages:
        sep = "" if not out or m["role"] == "assistant" else "\n\n"
        out += sep + m["content"]
    return out


def classify_http_error(status: int, body: str) -> str:
    if status in (400, 413, 422) and OVERFLOW_RE.search(body or ""):
        return "context_overflow"
    if status == 429:
        return "http_429"
    return "http_4xx" if 400 <= status < 500 else "http_5xx"


def _delta_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:
        d = c.get("delta") or {}
        return (d.get("content") or "") + (d.get("reasoning_content") or d.get("reasoning") or "")
    return c.get("text") or ""


def _carries_tokens(chunk: dict) -> bool:
    """A chunk that reports generated tokens: visible text, or an empty text delta mid-stream
    (servers such as vLLM and flashlane stream one when the new tokens decode to nothing, e.g.
    skipped special tokens). The chat role announcement and a bare finish chunk are not tokens."""
    if _delta_text(chunk):
        return True
    choices = chunk.get("choices") or []
    if not choices or choices[0].get("finish_reason"):
        return False
    c = choices[0]
    if "delta" in c:
        d = c.get("delta") or {}
        return "role" not in d and isinstance(d.get("content"), str)
    return isinstance(c.get("text"), str)


@dataclass
class _Stream:
    """What the event stream of one request delivered so far."""
    pieces: list[str] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)   # arrival of each chunk carrying tokens
    usage: dict | None = None
    finish: str | None = None

    def take(self, chunk: dict, t: float) -> bool:
        """Add one chunk that arrived at ``t``; whether it carried tokens."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if choices and choices[0].get("finish_reason"):
            self.finish = choices[0]["finish_reason"]
        if not _carries_tokens(chunk):
            return False
        self.chunk_times.append(t)
        self.pieces.append(_delta_text(chunk))
        return True


async def send_request(client: httpx.AsyncClient, target: Target, messages: list[dict],
                       max_tokens: int, ignore_eos: bool, rec: RequestRecord,
                       keep_text: bool = False) -> str:
    """Stream one request; returns the generated text ('' on error)."""
    body = build_body(target, messages, max_tokens, ignore_eos)
    rec.requested_output_tokens = max_tokens
    rec.ignore_eos = ignore_eos
    stream = _Stream()
    rec.send_time = now()
    if rec.issue_time is None:
        rec.issue_time = rec.send_time
    try:
        if not await _exchange(client, target, body, rec, stream):
            return ""
    except asyncio.CancelledError:
        _fail_now(rec, "cancelled", "request cancelled by the client")
        raise
    except httpx.TimeoutException as e:
        _fail_now(rec, "timeout", f"{type(e).__name__}: {e}")
        return ""
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        _fail_now(rec, "connection", f"{type(e).__name__}: {e}")
        return ""
    except httpx.HTTPError as e:
        _fail_now(rec, "http_other", f"{type(e).__name__}: {e}")
        return ""
    rec.end_time = now()
    return _complete(rec, stream, keep_text)


async def _exchange(client: httpx.AsyncClient, target: Target, body: dict, rec: RequestRecord,
                    stream: _Stream) -> bool:
    """POST ``body`` and read its event stream into ``stream``; False once ``rec`` is failed (an
    HTTP error status or a bad stream). Transport errors propagate."""
    async with client.stream("POST", target.url, json=body,
                             timeout=httpx.Timeout(target.request_timeout_s, connect=30.0)) as resp:
        rec.http_status = resp.status_code
        if resp.status_code >= 400:
            text = (await resp.aread()).decode(errors="replace")
            _fail_now(rec, classify_http_error(resp.status_code, text), text)
            return False
        return await _read_events(resp, rec, stream)


async def _read_events(resp: httpx.Response, rec: RequestRecord, stream: _Stream) -> bool:
    """The SSE ``data:`` events up to ``[DONE]``, the first token's time going into ``rec`` as it
    arrives; False once ``rec`` is failed (malformed data or an error event)."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        t = now()
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            _fail_now(rec, "stream_error", f"malformed SSE data: {data[:200]}")
            return False
        if "error" in chunk:
            msg = json.dumps(chunk["error"])[:500]
            _fail_now(rec, "context_overflow" if OVERFLOW_RE.search(msg) else "stream_error", msg)
            return False
        if stream.take(chunk, t) and rec.first_token_time is None:
            rec.first_token_time = t
    return True


def _complete(rec: RequestRecord, stream: _Stream, keep_text: bool) -> str:
    """Fill ``rec`` from a stream that ended normally; the generated text ('' when it held no token)."""
    chunk_times = stream.chunk_times
    rec.finish_reason = stream.finish
    rec.num_chunks = len(chunk_times)
    rec.last_token_time = chunk_times[-1] if chunk_times else None
    if stream.usage:
        rec.usage_reported = True
        rec.input_tokens = stream.usage.get("prompt_tokens")
        rec.output_tokens = stream.usage.get("completion_tokens")
        details = stream.usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens")
    else:
        rec.output_tokens = len(chunk_times)  # fallback: one token per chunk (flagged)
        rec.input_tokens = rec.requested_input_tokens
    if not chunk_times:
        _fail(rec, "empty_output", "stream ended without any token")
        return ""
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    per_chunk = (rec.output_tokens or 0) / len(chunk_times)
    if gaps and per_chunk > 1.05:  # chunks carry several tokens (spec decode / batching)
        gaps = [g / per_chunk for g in gaps]
    rec.chunk_gaps_s = [round(g, 6) for g in gaps]
    rec.status = STATUS_OK
    text = "".join(stream.pieces)
    if keep_text:
        rec.output_text = text
    return text


def _fail_now(rec: RequestRecord, cls: str, msg: str) -> None:
    """The request ends here, failed."""
    rec.end_time = now()
    _fail(rec, cls, msg)


def _fail(rec: RequestRecord, cls: str, msg: str) -> None:
    rec.status = STATUS_ERROR
    rec.error_class = cls
    rec.error_message = (msg or "")[:500]


async def fetch_json(client: httpx.AsyncClient, url: str, timeout: float = 5.0):
    """GET a JSON document; None when unavailable."""
    try:
        r = await client.get(url, timeout=timeout)
        if r.status_code == 200:
            return r.json()
    except (httpx.HTTPError, ValueError):
        pass
    return None


def make_client(max_connections: int = 1000) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0))
