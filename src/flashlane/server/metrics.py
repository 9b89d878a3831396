"""Prometheus metrics, one registry per app, named like vLLM's with a ``flashlane:`` prefix.

Latency histograms are observed by the server as requests finish; everything the engine owns
(running/waiting, pages, state slots, preemptions, token and finish-reason counters) is read
from an engine snapshot at scrape time, so the numbers cannot drift from the engine's truth
(an aborted request, for instance, is counted by the engine whoever aborted it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.http_responses = Counter("flashlane:http_requests", "HTTP responses by status code",
                                      ["status"], registry=r)
        self.ttft = Histogram("flashlane:time_to_first_token_seconds", "Time to first token (engine arrival "
                              "to first sampled token)", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("flashlane:inter_token_latency_seconds", "Time between consecutive output tokens",
                             m, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("flashlane:e2e_request_latency_seconds", "Engine arrival to the last token",
                             m, buckets=_LATENCY_BUCKETS, registry=r)
        self._snapshot: dict = {}
        r.register(_EngineCollector(self))

    def observe_finished(self, metrics) -> None:
        """Latencies of a request that finished normally (``RequestMetrics``)."""
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.labels(self.model_name).observe(max(metrics.ttft, 0.0))
        times = metrics.token_times
        itl = self.itl.labels(self.model_name)
        for a, b in zip(times, times[1:]):
            itl.observe(max(b - a, 0.0))
        if metrics.e2e is not None:
            self.e2e.labels(self.model_name).observe(max(metrics.e2e, 0.0))

    def count_response(self, status: int) -> None:
        self.http_responses.labels(str(status)).inc()

    def render(self, snapshot: dict) -> bytes:
        self._snapshot = snapshot
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the snapshot handed to ``render`` (engine.stats_snapshot())."""

    def __init__(self, owner: ServerMetrics):
        self.owner = owner

    def describe(self):
        return []

    def collect(self):
        s, name = self.owner._snapshot, self.owner.model_name

        def gauge(metric: str, doc: str, value) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], float(value))
            return g

        def counter(metric: str, doc: str, value) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], float(value))
            return c

        if "engine_state" in s:   # EngineClient.stats_snapshot adds it to the engine's own numbers
            states = GaugeMetricFamily("flashlane:engine_state", "The engine's state: 1 for the current one of "
                                       "running, restarting (its process died, another is starting) and dead "
                                       "(stopped for good), 0 for the others",
                                       labels=["model_name", "state"])
            for state in ("running", "restarting", "dead"):
                states.add_metric([name, state], float(s["engine_state"] == state))
            yield states
            yield counter("flashlane:engine_restarts", "Engine processes started again after one died",
                          s["engine_restarts"])
        if "running" not in s:   # no engine snapshot taken yet
            return
        yield gauge("flashlane:num_requests_running", "Requests holding cache and being stepped", s["running"])
        yield gauge("flashlane:num_requests_waiting", "Requests queued for admission", s["waiting"])
        yield gauge("flashlane:cache_pages_used", "KV/latent cache pages in use", s["pages_used"])
        yield gauge("flashlane:cache_pages_free", "KV/latent cache pages free", s["pages_free"])
        yield gauge("flashlane:kv_cache_usage_perc", "Fraction of cache pages in use (1 = full)",
                    s["pages_used"] / s["pages_total"] if s["pages_total"] else 0.0)
        yield gauge("flashlane:state_slots_used", "Per-sequence state slots (KDA state, indexer tail) in use",
                    s["slots_used"])
        yield gauge("flashlane:state_slots_free", "Per-sequence state slots free", s["slots_free"])
        yield counter("flashlane:num_preemptions", "Requests preempted (recomputed) for lack of cache",
                      s["preemptions"])
        yield counter("flashlane:prompt_tokens", "Prefill tokens computed (recomputation after preemption "
                      "included)", s.get("tokens_prompt_tokens", 0))
        yield counter("flashlane:generation_tokens", "Tokens generated", s.get("tokens_generation_tokens", 0))
        yield from _prefix_cache_metrics(s, gauge, counter, name)
        yield from _speculative_metrics(s, gauge, counter, name)
        reasons = s.get("finish_reasons", {})
        c = CounterMetricFamily("flashlane:request_success", "Finished requests by finish reason",
                                labels=["model_name", "finished_reason"])
        for reason in sorted(set(FINISH_REASONS) | set(reasons)):
            c.add_metric([name, reason], float(reasons.get(reason, 0)))
        yield c


def _speculative_metrics(s: dict, gauge, counter, name: str):
    """vLLM-style speculative decoding counters (zero when it is off) and the mean acceptance length."""
    drafts = s.get("spec_drafts", 0)
    yield counter("flashlane:spec_decode_num_drafts", "Draft runs verified (one per sequence and step)", drafts)
    yield counter("flashlane:spec_decode_num_draft_tokens", "Draft tokens verified", s.get("spec_draft_tokens", 0))
    accepted = s.get("spec_accepted_tokens", 0)
    yield counter("flashlane:spec_decode_num_accepted_tokens", "Draft tokens accepted", accepted)
    per_pos = CounterMetricFamily("flashlane:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by their position in the draft",
                                  labels=["model_name", "position"])
    positions = sorted(int(k[len("spec_accepted_pos"):]) for k in s if k.startswith("spec_accepted_pos"))
    for pos in positions:
        per_pos.add_metric([name, str(pos)], float(s[f"spec_accepted_pos{pos}"]))
    yield per_pos
    yield gauge("flashlane:spec_decode_mean_acceptance_length", "Tokens gained per verified draft run (1 + "
                "accepted drafts; 0 before any)", 1 + accepted / drafts if drafts else 0.0)


def _prefix_cache_metrics(s: dict, gauge, counter, name: str):
    """vLLM-style prefix-cache counters (tokens), hits per tier, evictions, pools and tier bytes."""
    yield gauge("flashlane:cache_pages_cached", "Registered pages no request references (reusable, "
                "reclaimed when pages run out)", s.get("pages_cached", 0))
    yield counter("flashlane:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                  s.get("prefix_cache_queries", 0))
    yield counter("flashlane:prefix_cache_hits", "Prompt tokens served from the prefix cache",
                  s.get("prefix_cache_hits", 0))
    tiers = CounterMetricFamily("flashlane:prefix_cache_hits_by_tier", "Prompt tokens served from the prefix "
                                "cache, by the tier that held them", labels=["model_name", "tier"])
    for tier in ("pool", "host", "disk"):
        tiers.add_metric([name, tier], float(s.get(f"prefix_cache_hits_{tier}", 0)))
    yield tiers
    yield counter("flashlane:prefix_cache_page_evictions", "Cached pages evicted from the pool",
                  s.get("prefix_cache_page_evictions", 0))
    yield counter("flashlane:prefix_cache_checkpoint_evictions", "State checkpoints evicted from the pool",
                  s.get("prefix_cache_checkpoint_evictions", 0))
    yield counter("flashlane:prefix_cache_checkpoint_restores", "Hits that restored a state checkpoint",
                  s.get("prefix_cache_checkpoint_restores", 0))
    yield counter("flashlane:prefix_cache_disk_corrupt", "Disk-tier files rejected (checksum or format)",
                  s.get("prefix_cache_disk_corrupt", 0))
    yield counter("flashlane:prefix_cache_disk_rejected", "Disk-tier entries that were not regular files "
                  "(directory, FIFO, device, symlink): ignored and removed where possible",
                  s.get("prefix_cache_disk_rejected", 0))
    errors = CounterMetricFamily("flashlane:prefix_cache_disk_errors", "Disk-tier file operations that failed "
                                 "(the entry was skipped), by operation", labels=["model_name", "op"])
    for op in ("read", "write", "remove", "list"):
        errors.add_metric([name, op], float(s.get(f"prefix_cache_disk_errors_{op}", 0)))
    yield errors
    yield counter("flashlane:prefix_cache_disk_load_timeouts", "Disk-tier loads given up at the deadline "
                  "(disk_load_timeout_s); that part of the prompt was recomputed",
                  s.get("prefix_cache_disk_load_timeouts", 0))
    if "disk_cache_state" in s:
        yield gauge("flashlane:disk_cache_state", "State of the disk tier: 2 = read-write, 1 = read-only "
                    "(writes failed repeatedly: full, quota, read-only fs, I/O or permission errors), "
                    "0 = off (repeated read I/O errors or the directory vanished)", s["disk_cache_state"])
    yield gauge("flashlane:checkpoints_used", "State checkpoints held in the pool", s.get("checkpoints_used", 0))
    yield gauge("flashlane:checkpoints_total", "State checkpoint pool capacity", s.get("checkpoints_total", 0))
    for tier in ("host", "disk"):
        if f"{tier}_cache_bytes_used" in s:
            yield gauge(f"flashlane:{tier}_cache_bytes_used", f"Bytes held by the {tier} tier",
                        s[f"{tier}_cache_bytes_used"])
            yield gauge(f"flashlane:{tier}_cache_bytes_total", f"Byte budget of the {tier} tier (0 = unbounded)",
                        s[f"{tier}_cache_bytes_total"])
