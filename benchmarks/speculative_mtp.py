"""Issue 23 (b): MTP speculative decoding on the random-weight GLM presets (tiny-flash and
tiny-standard), k = 3, with synthetic acceptance (mean length 2.99, InferenceX's golden value for
GLM-5.2 with 3 drafts: random MTP weights accept nothing, so the speed effect is measured at a
realistic acceptance), eager and with static graphs (`compile=True` on both sides), at
concurrency 1 and 4, against the same engine with speculation off. With static graphs a verify
step runs through the decode graphs (one row per verified token) where no layer keeps
per-sequence state (tiny-standard), and through graphs of 1 + k tokens per sequence where it
does (tiny-flash: KDA and indexer-tail state, whose state after each verified token the graph
keeps, so a rejection copies the accepted one back); the MTP layer's
chained drafts run in a compiled region, and so does its catch-up over the committed tokens
where it keeps no per-sequence state (tiny-standard) or there is one such token. Offline engines (`flashlane.LLM`), both built once and warmed up, same dtype and threads;
each round runs the same prompts on both sides in ABBA order, so each round gives paired figures.

Reported per model and concurrency: decode tokens/s per request (output tokens after the first
over the time from first to last token; paired ratio on/off, > 1 means speculation is faster),
the measured mean acceptance length, the MTP layer's cache bytes per token from `cache_spec`
and, for tiny-flash, the rollback state per running request; (c) the cache memory speculation
adds, measured on the allocated pools against `cache_spec` (rollback rows per running request;
the MTP layer's rows, its indexer tail and the saved hidden states). Synthetic acceptance means
the outputs are not the model's: this measures speed only.

    python benchmarks/speculative_mtp.py                   # -> benchmarks/results/speculative_mtp.json
    python benchmarks/speculative_mtp.py --quick --out /tmp/speculative_mtp.json
    python benchmarks/speculative_mtp.py --modes static   # static graphs only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from common import write_result
from flashlane import LLM, SamplingParams

MODELS = ("tiny-flash", "tiny-standard")
K, LENGTH = 3, 2.99
GOAL = 2.0      # decode tok/s per request, MTP / off, concurrency 1 (the issue asks it with static graphs)


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def decode_rates(outputs) -> list[float]:
    rates = []
    for o in outputs:
        m = o.metrics
        span = m.finish_time - m.first_token_time
        rates.append((len(o.token_ids) - 1) / span)
    return rates


def run_side(llm: LLM, batch: list[list[int]], params: SamplingParams) -> list[float]:
    return decode_rates(llm.generate(batch, params))


def measure(model: str, concurrency: int, rounds: int, prompt_len: int, max_tokens: int,
            mode: str = "eager") -> dict:
    spec = {"method": "mtp", "num_speculative_tokens": K, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": LENGTH}
    kw = dict(max_num_seqs=max(4, concurrency), compile=mode == "static")
    sides = {"off": LLM(model, **kw), "mtp": LLM(model, **kw, speculative_config=spec)}
    graphs = sides["mtp"].engine.runner.compiled
    vocab = sides["off"].engine.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    warm = prompts(concurrency, prompt_len, vocab, seed=999)
    for llm in sides.values():
        llm.generate(warm, params)
        llm.engine.spec_counters.clear()
    graph_calls = dict(graphs.calls) if graphs is not None else {}
    ratios, rates = [], {s: [] for s in sides}
    for r in range(rounds):
        batch = prompts(concurrency, prompt_len, vocab, seed=r)
        got = {}
        for side in (("off", "mtp", "mtp", "off") if r % 2 == 0 else ("mtp", "off", "off", "mtp")):
            got.setdefault(side, []).append(run_side(sides[side], batch, params))
        mean = {s: statistics.fmean(statistics.fmean(x) for x in v) for s, v in got.items()}
        for s in sides:
            rates[s].append(mean[s])
        ratios.append(mean["mtp"] / mean["off"])
    c = sides["mtp"].engine.spec_counters
    info = sides["mtp"].engine.info
    verified_in_graphs = (sum(graphs.calls.values()) - sum(graph_calls.values())) if graphs is not None else 0
    return {
        "model": model, "mode": mode, "concurrency": concurrency, "rounds": rounds,
        "mtp_steps_through_graphs": verified_in_graphs,
        "dtype": info.dtype, "num_threads": info.num_threads,
        "decode_tok_s_per_request": {s: round(statistics.fmean(v), 2) for s, v in rates.items()},
        "ratio_mtp_over_off": {"mean": round(statistics.fmean(ratios), 3), "min": round(min(ratios), 3),
                               "max": round(max(ratios), 3), "per_round": [round(x, 3) for x in ratios]},
        "mean_acceptance_length": round(1 + c["spec_accepted_tokens"] / max(c["spec_drafts"], 1), 3),
        "mtp_cache_bytes_per_token": info.speculative["mtp_bytes_per_token"],
        "rollback_bytes_per_running_request": (info.speculative["rollback_bytes"] // info.speculative["rollback_rows"]
                                               if info.speculative["rollback_rows"] else 0),
        "describe": sides["mtp"].engine.describe_cache().split("; speculative decoding ")[-1],
        # static graphs with per-sequence state: the per-token states of a verify step, allocated
        # against cache_spec's count for every sequence of the largest bucket
        "verify_state_bytes": {
            "measured": info.speculative.get("verify_state_bytes", 0),
            "cache_spec": (graphs.max_size * sides["mtp"].engine.cache.spec.verify_state_bytes_per_sequence(K, info.dtype)
                           if graphs is not None and graphs.step_states is not None else 0)},
    }


def memory(model: str, num_pages: int = 64, num_slots: int = 8) -> dict:
    """(c) What speculation costs in cache memory, measured on the allocated pools against
    cache_spec, with the same page and slot counts: off, n-gram (a rollback row per slot) and MTP
    (that, plus the MTP layer's latent / index rows and saved hidden states per page and its
    indexer tail per state row)."""
    kw = dict(num_pages=num_pages, num_slots=num_slots, max_num_seqs=num_slots, skip_tokenizer_init=True)
    out = {"model": model, "num_pages": num_pages, "num_slots": num_slots}
    for side, spec in (("off", None), ("ngram", {"method": "ngram", "num_speculative_tokens": K}),
                       ("mtp", {"method": "mtp", "num_speculative_tokens": K})):
        e = LLM(model, **kw, speculative_config=spec).engine
        t, info = e.cache.tensors, e.info
        predicted = info.bytes_per_page * t.num_pages + info.bytes_per_slot * t.num_state_rows
        s = info.speculative or {}
        out[side] = {"measured_bytes": t.nbytes(), "cache_spec_bytes": predicted,
                     "bytes_per_page": info.bytes_per_page, "bytes_per_slot": info.bytes_per_slot,
                     "state_rows": t.num_state_rows, "rollback_rows": s.get("rollback_rows", 0),
                     "rollback_bytes_per_running_request": (s["rollback_bytes"] // s["rollback_rows"]
                                                            if s.get("rollback_rows") else 0),
                     "mtp_bytes_per_token": s.get("mtp_bytes_per_token", 0.0)}
    out["speculation_adds_per_running_request"] = {
        side: (out[side]["measured_bytes"] - out["off"]["measured_bytes"]) / num_slots for side in ("ngram", "mtp")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one model, 2 rounds, short prompts (a smoke run)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", default="eager,static", help="eager, static (static graphs) or both")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if not modes or set(modes) - {"eager", "static"}:
        ap.error(f"--modes takes eager and/or static, got {a.modes!r}")
    models = MODELS[:1] if a.quick else MODELS
    rounds, prompt_len, max_tokens = (2, 128, 24) if a.quick else (a.rounds, 512, 64)
    mem = [memory(m) for m in models]
    runs = [measure(m, c, rounds, prompt_len, max_tokens, mode) for mode in modes for m in models for c in (1, 4)]
    c1 = {mode: [r["ratio_mtp_over_off"]["mean"] for r in runs if r["concurrency"] == 1 and r["mode"] == mode]
          for mode in modes}
    write_result("speculative_mtp", {
        "what": f"MTP k=3, synthetic acceptance length 2.99 (outputs not the model's), {' and '.join(modes)}, "
                "vs speculation off in the same mode",
        "prompt_tokens": prompt_len, "max_tokens": max_tokens, "load_avg": os.getloadavg(),
        "runs": runs,
        "memory": mem,
        "goal": {"decode_tok_s_per_request_ratio_at_c1": GOAL,
                 **{f"met_{mode}": all(x >= GOAL for x in c1[mode]) for mode in modes},
                 "static_graphs": "verify steps in static graphs (tiny-standard: one decode row per token; "
                                  "tiny-flash: graphs of 1 + k tokens per sequence keeping per-token "
                                  "states, a copy on a rejection); MTP chained drafts and catch-up "
                                  "compiled (tiny-flash: per catch-up count)"},
    }, a.out)


if __name__ == "__main__":
    main()
