"""AIPerf against `flashlane serve`: 0 protocol errors, and the time to the first streamed chunk
AIPerf reads equals the server's own time to the first generated token.

The server's TTFT is its `flashlane:time_to_first_token_seconds` histogram (arrival to first
token, scraped before and after the run); AIPerf's is the time to the first streamed chunk. Before
the role chunk travelled with the first token, the two differed by the whole prefill.

AIPerf lives in a venv of its own (it is a peer, not a dependency):
    python -m venv /tmp/venv-aiperf && /tmp/venv-aiperf/bin/pip install "aiperf==0.13.*"
    python benchmarks/peer_clients.py --aiperf /tmp/venv-aiperf/bin/aiperf
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import httpx

from common import Timer, served, write_result

TTFT = "flashlane:time_to_first_token_seconds"


def _histogram(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of a Prometheus histogram, all label sets together."""
    text = httpx.get(url + "/metrics").text
    total = count = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}_(sum|count)(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
        if m:
            if m.group(1) == "sum":
                total += float(m.group(2))
            else:
                count += float(m.group(2))
    return total, count


def _metric(export: dict, name: str, stat: str = "avg"):
    value = export.get(name)
    return value.get(stat) if isinstance(value, dict) else None


def first_chunk_probe(url: str, model: str, prompt_words: int, max_tokens: int) -> dict:
    """What ``vllm bench serve --backend openai-chat`` reads as TTFT (the first streamed chunk of
    any kind) against the first chunk that carries generated text, for one streamed chat."""
    import time

    body = {"model": model, "messages": [{"role": "user", "content": " ".join(["word"] * prompt_words)}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    first = first_text = None
    chunks = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter() - t0
            chunks += 1
            first = now if first is None else first
            choices = json.loads(line[6:]).get("choices") or [{}]
            if first_text is None and (choices[0].get("delta") or {}).get("content"):
                first_text = now
    return {"first_chunk_s": first, "first_text_chunk_s": first_text, "chunks": chunks,
            "first_chunk_over_first_text": first / first_text if first and first_text else None}


def run_aiperf(aiperf: str, url: str, model: str, tokenizer: str, args, endpoint: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        before = _histogram(url, TTFT)
        cmd = [aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", endpoint, "--streaming",
               "--tokenizer", tokenizer, "--prompt-input-tokens-mean", str(args.input_tokens),
               "--prompt-input-tokens-stddev", "0", "--prompt-output-tokens-mean", str(args.output_tokens),
               "--prompt-output-tokens-stddev", "0", "--request-count", str(args.requests),
               "--concurrency", "1", "--output-artifact-dir", out, "--ui-type", "none", "--no-server-metrics",
               "--no-gpu-telemetry", "--random-seed", "0"]
        with Timer() as t:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        after = _histogram(url, TTFT)
        exports = sorted(Path(out).rglob("profile_export_aiperf.json"))
        export = json.loads(exports[0].read_text()) if exports else {}
    server_n = after[1] - before[1]
    server_ttft = (after[0] - before[0]) / server_n if server_n else None
    client_ttft_ms = _metric(export, "time_to_first_token")
    client_ttft = client_ttft_ms / 1000 if client_ttft_ms is not None else None
    return {
        "endpoint": endpoint, "exit_code": proc.returncode, "seconds": round(t.seconds, 1),
        "requests": _metric(export, "request_count"), "errors": export.get("error_summary") or [],
        "client_ttft_s": client_ttft, "server_ttft_s": server_ttft, "server_requests": server_n,
        "client_over_server_ttft": (client_ttft / server_ttft) if client_ttft and server_ttft else None,
        "stderr_tail": proc.stderr[-1500:] if proc.returncode else "",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiperf", default=os.environ.get("AIPERF", "/tmp/venv-aiperf/bin/aiperf"))
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--input-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from flashlane.presets import preset_path

    tokenizer = str(preset_path(args.model))
    url = f"http://127.0.0.1:{args.port}"
    runs = []
    with served(args.model, args.port, ["--no-enable-prefix-caching"]):
        probes = [first_chunk_probe(url, args.model, args.input_tokens, args.output_tokens) for _ in range(3)]
        for endpoint in ("chat", "completions"):
            runs.append(run_aiperf(args.aiperf, url, args.model, tokenizer, args, endpoint))
    version = subprocess.run([args.aiperf, "--version"], capture_output=True, text=True).stdout.strip()
    write_result("peer_clients", {
        "model": args.model, "aiperf": version, "load_average": os.getloadavg(),
        "input_tokens": args.input_tokens, "output_tokens": args.output_tokens, "runs": runs,
        "first_chunk_probes": probes,
        "goal": "0 errors; client_over_server_ttft near 1, and first_chunk_over_first_text 1 (the first chunk "
                "comes with the first token, as vllm bench serve times it)",
    }, args.out)


if __name__ == "__main__":
    main()
