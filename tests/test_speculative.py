"""Speculative decoding (n-gram drafts, greedy verification, rollback): token ids equal speculation
off for every architecture under batching, chunked prefill, preemption and prefix-cache hits;
the state rows after a rejection equal a run without drafts; bad configurations are refused by
name."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flashlane import LLM, SamplingParams
from flashlane.cli.engine_flags import engine_kwargs_of_flags, flags_of_engine_kwargs
from flashlane.engine.speculative import NgramDrafter, SpeculativeConfig, accept_greedy, accept_sampled

from engine_models import preset, random_prompts, small_glm, tiny_llama
from graph_profile import aten_matmuls_inside_graphs, graph_calls

MODELS = ["tiny-llama", "tiny-flash", "tiny-standard"]
HIDDEN = ["small-glm5_next", "small-glm_moe_dsa"]     # other depths and layer patterns than the presets


def _model(name):
    if name.startswith("small-"):
        return small_glm(name[len("small-"):], seed=4)
    return tiny_llama() if name == "tiny-llama" else preset(name)


def _llm(m, k: int | None = None, **kw):
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k}
    return LLM(m, **{"dtype": "float32", "cache_memory": 64 << 20, "speculative_config": spec, **kw})


def _prompts(m, n: int, seed: int) -> list[list[int]]:
    """Prompts with repeats inside (as agentic ones have), so n-gram drafts are both accepted and rejected."""
    vocab = min(m.config.vocab_size, 4000)
    out = []
    for i, p in enumerate(random_prompts(n, 20, 90, vocab, seed=seed)):
        out.append(p + p[: 10 + 7 * i] + p[5:40])
    return out


def _drafted(llm) -> tuple[int, int]:
    s = llm.engine.stats()
    return s.get("spec_draft_tokens", 0), s.get("spec_accepted_tokens", 0)


# ---- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("value, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "speculative_config.prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
    ("{not json", "speculative_config"),
    ([1, 2], "speculative_config"),
])
def test_bad_configuration_names_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        _llm(tiny_llama(), speculative_config=value)


def test_serve_flag_round_trips_and_refuses_bad_json():
    kw = engine_kwargs_of_flags(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert kw["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 4}
    assert engine_kwargs_of_flags(flags_of_engine_kwargs(kw)) == kw
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        engine_kwargs_of_flags(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'])


def test_ngram_proposes_the_latest_longest_match():
    d = NgramDrafter(3, 1, 3)
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3]) == [4, 9, 1]
    assert d.propose([1, 2, 3, 4, 9, 1, 2, 3], limit=1) == [4]
    assert d.propose([5, 1, 7, 8, 1, 6, 2, 1]) == [6, 2, 1]      # the latest "1", no longer match
    assert d.propose([5, 6, 7]) == []
    assert d.propose([4]) == []
    assert NgramDrafter(2, 2, 2).propose([1, 2, 5, 3, 2]) == []   # only 1-grams match


def test_greedy_acceptance():
    assert accept_greedy([4, 9, 1], [4, 9, 1, 7]) == [4, 9, 1, 7]
    assert accept_greedy([4, 9, 1], [4, 8, 1, 7]) == [4, 8]
    assert accept_greedy([4], [5, 6]) == [5]
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1])


# ---- exactness ------------------------------------------------------------------------------------
class _Oracle:
    """Drafts what the plain run produced next, wrong from a draft position picked from ``wrong``
    by the request's own tokens (so a request gets the same drafts in any batch), so verify steps
    accept every length from none to all. ``refs``: each prompt's plain output; a request is told
    by the longest prompt its tokens start with."""

    lookahead = 0

    def __init__(self, refs: dict[tuple, list[int]], k: int, wrong: list[int] | None = None):
        self.refs, self.k = refs, k
        self.wrong = wrong if wrong is not None else list(range(k + 1))

    def draft(self, req, limit):
        return self.propose(req.all_token_ids, limit)

    def propose(self, tokens, limit=None):
        n = min(self.k, limit if limit is not None else self.k)
        prompt = max((p for p in self.refs if tuple(tokens[: len(p)]) == p), key=len)
        at = len(tokens) - len(prompt)
        truth = self.refs[prompt][at: at + n]
        bad = self.wrong[hash(tuple(tokens)) % len(self.wrong)]     # (ints hash the same in every run)
        return [t if i < bad else (t + 1) % 200 + 3 for i, t in enumerate(truth)]


def _with_oracle(llm, prompts, outputs, k: int):
    llm.engine.scheduler.drafter = _Oracle({tuple(p): list(o) for p, o in zip(prompts, outputs)}, k)
    return llm


@pytest.mark.parametrize("name", MODELS + HIDDEN)
@pytest.mark.parametrize("k", [1, 4])   # 2 adds ~20 s and no path 1 and 4 miss
def test_ids_equal_speculation_off_batched_and_chunked(name, k):
    m = _model(name)
    prompts = _prompts(m, 6, seed=k)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in _llm(m, max_num_batched_tokens=64).generate(prompts, params)]
    spec = _with_oracle(_llm(m, k, max_num_batched_tokens=64), prompts, want, k)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    drafted, accepted = _drafted(spec)
    assert 0 < accepted < drafted, (drafted, accepted)      # both paths taken: accepted and rolled back
    alone = [spec.generate([p], params)[0].token_ids for p in prompts[:2]]
    assert alone == want[:2]
    usage = spec.engine.cache.usage()
    assert usage["pages_used"] == 0 and usage["slots_used"] == 0


def test_ngram_drafts_on_a_model_that_repeats_itself():
    """Real n-gram drafts (the random tiny Llama over 256 tokens falls into loops, as agents
    repeat their context): ids equal speculation off, drafts both accepted and rejected."""
    m = tiny_llama()
    prompts = _prompts(m, 6, seed=9)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in _llm(m).generate(prompts, params)]
    spec = _llm(m, 3, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    drafted, accepted = _drafted(spec)
    assert 0 < accepted < drafted
    out = spec.generate(prompts[:1], params)[0]
    assert out.metrics.num_draft_tokens > 0 and out.metrics.num_accepted_tokens <= out.metrics.num_draft_tokens


@pytest.mark.parametrize("name", MODELS)
def test_ids_equal_under_preemption_and_stop_tokens(name):
    m = _model(name)
    prompts = _prompts(m, 8, seed=31)
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)] * 4
    plain = _llm(m, enable_prefix_caching=False)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    # a stop token the plain run produces mid-output must end the speculative run at the same place
    stop = want[0][12]
    stopped = [SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop])] + params[1:]
    want_stopped = [o.token_ids for o in plain.generate(prompts, stopped)]
    tight = _with_oracle(_llm(m, 3, num_pages=30, num_slots=6, max_num_batched_tokens=128,
                              enable_prefix_caching=False), prompts, want, 3)
    assert [o.token_ids for o in tight.generate(prompts, params)] == want
    assert tight.engine.scheduler.num_preemptions >= 1
    assert _drafted(tight)[1] > 0
    assert [o.token_ids for o in tight.generate(prompts, stopped)] == want_stopped


def check_prefix_hit_then_rejection(m, plain, spec_with_oracle) -> None:
    """A four-turn session (each turn's prompt extends the last turn's): ids and cached-token
    counts equal the plain run's, later turns hit, drafts are both accepted and rejected.
    ``spec_with_oracle(prompts, outputs)``: the speculative engine with oracle drafts."""
    v = min(m.config.vocab_size, 4000)
    first = _prompts(m, 1, seed=41)[0]
    extra = random_prompts(4, 5, 30, v, seed=42)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    def conversation(llm):
        prompt, outs, prompts = list(first), [], []
        for t in range(4):
            out = llm.generate([prompt], params)[0]
            outs.append((out.token_ids, out.num_cached_tokens))
            prompts.append(prompt)
            prompt = prompt + out.token_ids + extra[t] + first[:12]
        return outs, prompts

    want, prompts = conversation(plain)
    spec = spec_with_oracle(prompts, [ids for ids, _ in want])
    got, _ = conversation(spec)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    assert [cached for _, cached in got] == [cached for _, cached in want]
    assert any(cached for _, cached in got[1:])
    drafted, accepted = _drafted(spec)
    assert 0 < accepted < drafted


@pytest.mark.parametrize("name", MODELS)
def test_prefix_hit_then_rejection_matches_plain(name):
    """vLLM #43559: after a prefix-cache hit, a partly rejected draft must leave the recurrent
    state where the accepted tokens put it (and checkpoints come from accepted tokens only)."""
    m = _model(name)
    check_prefix_hit_then_rejection(m, _llm(m), lambda prompts, outs: _with_oracle(_llm(m, 3), prompts, outs, 3))


def test_rejection_sampling_keeps_the_target_distribution():
    """Whatever the draft, the first token emitted is distributed as the target's p_0, and after
    an accepted draft the next as p_1."""
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(3, 12, generator=g) * 1.5, dim=-1)
    n = 20000
    for draft in ([int(probs[0].argmax())], [5, 7], [int(probs[0].argmin()), 1]):
        first = torch.zeros(12)
        second = torch.zeros(12)
        for _ in range(n):
            out = accept_sampled(probs, draft, torch.rand((3, 2), generator=g))
            first[out[0]] += 1
            if out[0] == draft[0] and len(out) > 1:
                second[out[1]] += 1
        assert (first / n - probs[0]).abs().sum() < 0.03, draft
        if second.sum() > 2000:
            assert (second / second.sum() - probs[1]).abs().sum() < 0.06, draft


def test_sampled_requests_speculate_and_keep_their_distribution():
    """Sampled requests verify drafts by rejection sampling: the token after the first follows
    the model's own tempered top-k distribution (chi-square against it, conditioned on the
    commonest first token), and seeded requests repeat themselves alone or in another batch."""
    m = tiny_llama()
    prompt = _prompts(m, 1, seed=5)[0]
    n, temp, top_k = 800, 0.7, 8
    params = [SamplingParams(max_tokens=3, temperature=temp, top_k=top_k, seed=s, ignore_eos=True) for s in range(n)]
    greedy = _llm(m).generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    spec = _with_oracle(_llm(m, 2), [prompt], [greedy], 2)    # the greedy path, or a wrong token
    got = [o.token_ids for o in spec.generate([prompt] * n, params)]
    drafted, accepted = _drafted(spec)
    assert 0 < accepted < drafted
    assert [o.token_ids for o in spec.generate([prompt] * 5, params[:5])] == got[:5]
    assert spec.generate([prompt], params[3])[0].token_ids == got[3]
    first = max(set(ids[0] for ids in got), key=lambda t: sum(ids[0] == t for ids in got))
    seconds = [ids[1] for ids in got if ids[0] == first]
    ref = _llm(m).generate([prompt + [first]], SamplingParams(max_tokens=1, temperature=0, logprobs=top_k))[0]
    top = dict(sorted(ref.logprobs[0].items(), key=lambda kv: -kv[1])[:top_k])
    weights = {t: math.exp(lp / temp) for t, lp in top.items()}
    total = sum(weights.values())
    assert set(seconds) <= set(top)
    bins = {}                 # tokens expected fewer than 5 times share one bin (chi-square's rule)
    for t, w in weights.items():
        expected = len(seconds) * w / total
        key = t if expected >= 5 else "rest"
        e, o = bins.get(key, (0.0, 0))
        bins[key] = (e + expected, o + seconds.count(t))
    chi2 = sum((o - e) ** 2 / e for e, o in bins.values())
    critical = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5, 7: 24.3}[max(1, len(bins) - 1)]   # p = 0.001
    assert len(seconds) >= 100 and chi2 < critical, (len(seconds), chi2, bins)


# ---- rollback -------------------------------------------------------------------------------------
def _state_rows(llm, req) -> dict[str, torch.Tensor]:
    """The request's state rows; of the indexer tail only the live entries (the keys of the
    incomplete pool: the rest are leftovers no step reads, and a chunk leaves other ones there
    than single-token steps do, speculation or not)."""
    cache = llm.engine.cache
    slot = cache.state_slot(req)
    rows = {name: t[:, slot].clone() for name, t in cache.snapshots.pools.items()}
    if "index_tail" in rows:
        rows["index_tail"] = rows["index_tail"][:, : req.num_computed_tokens % cache.spec.kpool]
    return rows


@pytest.mark.parametrize("name, static", [
    ("tiny-flash", False), ("small-glm5_next", False),
    pytest.param("small-glm5_next", True, marks=pytest.mark.slow)])
def test_state_rows_after_each_accept_length_equal_the_plain_run(name, static):
    """Hybrid models (KDA recurrent + conv state, indexer tail; the preset and a hidden three-layer
    config): after every accept length 0..k, each state row equals the plain run's there (to
    1e-5: verify and replay chunks round differently from single-token decode steps). ``static``:
    the verify steps run through static graphs (k + 1 tokens per sequence, the stateful layers'
    state after each token kept, and the accepted one copied back instead of a replay)."""
    m = _model(name)
    prompt = _prompts(m, 1, seed=61)[0]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    plain = _llm(m, enable_prefix_caching=False)
    req = plain.engine.add_request("r", prompt, params)
    states = {}
    while plain.engine.has_unfinished():
        plain.engine.step()
        if not req.finished:
            states[req.num_computed_tokens] = _state_rows(plain, req)
    ref = req.output_token_ids
    assert plain.engine.cache.stateful
    k = 4
    graphs = dict(compile=True, compile_sizes=(1,), max_num_seqs=1) if static else {}
    spec = _llm(m, k, enable_prefix_caching=False, **graphs)
    spec.engine.scheduler.drafter = _Oracle({tuple(prompt): ref}, k)
    if static:
        assert spec.engine.runner.compiled.verify_rows == k + 1
        verified = []
        fits = spec.engine.runner._fits_graph
        spec.engine.runner._fits_graph = lambda seqs: verified.append(fits(seqs) and bool(seqs[0].draft)) or fits(seqs)
        step_states = spec.engine.runner.compiled.step_states
        restore, copied = step_states.restore, []
        step_states.restore = lambda seqs, kept, slots: copied.append(kept) or restore(seqs, kept, slots)
        spec.engine.runner.state_replay = None          # a verify step in graphs never replays
    sreq = spec.engine.add_request("r", prompt, params)
    seen = set()
    while spec.engine.has_unfinished():
        before = sreq.num_computed_tokens
        spec.engine.step()
        if sreq.finished:
            break
        at = sreq.num_computed_tokens
        if at - before > 1 or at in states:
            got, want = _state_rows(spec, sreq), states[at]
            accepted = at - before - 1
            seen.add(accepted)
            for pool in want:       # (a verify chunk rounds differently from single-token steps)
                torch.testing.assert_close(got[pool], want[pool], rtol=1e-5, atol=1e-5)
    assert sreq.output_token_ids == ref
    assert {0, k} <= seen and len(seen & set(range(1, k))) >= 2     # none, some and all drafts kept
    assert spec.engine.info.speculative["rollback_rows"] == spec.engine.info.num_state_slots
    if static:      # the verify steps with k drafts ran in the graphs (fewer drafts near the end: eager)
        assert sum(verified) >= len(seen)
        copies = {n for kept in copied for n in kept}         # kept tokens of rejecting sequences: copies
        assert len(copies) >= 2 and copies <= set(range(1, k + 1))
        info = spec.engine.info.speculative
        assert info["verify_state_bytes"] == step_states.nbytes() == spec.engine.runner.compiled.max_size \
            * spec.engine.cache.spec.verify_state_bytes_per_sequence(k, spec.engine.info.dtype) > 0
        assert "per-token states" in spec.engine.describe_cache()


@pytest.mark.slow
def test_one_sequence_verify_graphs_multiply_inside_the_graph():
    """A one-sequence verify graph of 1 + k rows (k = 3; compiled_decode.FEW_ROWS) makes no call
    into aten's mm / addmm, as the batch-1 decode graphs make none; the tokens equal the plain
    run's (the state rows after each accept length: the static case of the test above)."""
    from torch.profiler import ProfilerActivity, profile

    m = _model("small-glm5_next")
    prompt = _prompts(m, 1, seed=62)[0]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = _llm(m, enable_prefix_caching=False).generate([prompt], params)[0].token_ids
    k = 3
    spec = _llm(m, k, enable_prefix_caching=False, compile=True, compile_sizes=(1,), max_num_seqs=1)
    spec.engine.scheduler.drafter = _Oracle({tuple(prompt): ref}, k)
    assert spec.engine.runner.compiled.verify_rows == k + 1
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = spec.generate([prompt], params)[0].token_ids
    events = prof.events()
    matmuls = aten_matmuls_inside_graphs(events)
    assert out == ref and _drafted(spec)[1] > 0
    assert graph_calls(events)
    assert not matmuls, f"{len(matmuls)} aten matmuls inside the one-sequence graphs"


def test_rollback_rows_are_planned_and_reported():
    m = preset("tiny-flash")
    off, on = _llm(m), _llm(m, 2)
    assert off.engine.info.speculative is None
    info = on.engine.info.speculative
    assert info["rollback_rows"] == on.engine.info.num_state_slots > 0
    assert info["rollback_bytes"] == info["rollback_rows"] * on.engine.info.bytes_per_slot
    assert on.engine.cache.tensors.num_state_rows == off.engine.cache.tensors.num_state_rows + info["rollback_rows"]
    assert "speculative decoding ngram k=2" in on.engine.describe_cache()
    assert info["verify_in_graphs"] is None and "graphs" not in on.engine.describe_cache()
    llama = _llm(tiny_llama(), 2).engine.info.speculative
    assert llama["rollback_rows"] == 0 and llama["rollback_bytes"] == 0


@pytest.mark.slow
def test_static_graphs_verify_drafts_where_no_layer_keeps_state():
    """With static graphs an n-gram verify step of llama runs through the decode graphs, and the
    start-up line says so; the ids equal the eager engine's."""
    m = tiny_llama()
    llm = _llm(m, 2, compile=True, compile_sizes=(4,), max_num_seqs=2)
    assert llm.engine.info.speculative["verify_in_graphs"] is True
    assert "verify steps through static graphs" in llm.engine.describe_cache()
    prompts = _prompts(m, 1, seed=5)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    graphs = llm.engine.runner.compiled
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in _llm(m).generate(prompts, params)]
    drafted, _ = _drafted(llm)
    assert drafted > 0 and sum(graphs.calls.values()) > 0


# ---- served ---------------------------------------------------------------------------------------
def test_served_with_speculation_reports_acceptance_on_metrics():
    from server_harness import LiveServer, metric

    m = tiny_llama()      # (a random model that repeats itself, so n-gram drafts are accepted)
    prompt = _prompts(m, 1, seed=71)[0]
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 40, "temperature": 0}
    want = _llm(m).generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0].token_ids
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    with LiveServer(m, served_model_name="tiny-llama", transport="thread", speculative_config=spec) as srv, \
            srv.client() as c:
        r = c.post("/v1/completions", json={**body, "return_token_ids": True})
        assert r.status_code == 200, r.text
        info = c.get("/v1/models").json()
        scraped = srv.wait_idle()
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want
    drafts = metric(scraped, "flashlane:spec_decode_num_drafts_total")
    drafted = metric(scraped, "flashlane:spec_decode_num_draft_tokens_total")
    accepted = metric(scraped, "flashlane:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted < drafted
    per_pos = metric(scraped, "flashlane:spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert per_pos > 0
    mean = metric(scraped, "flashlane:spec_decode_mean_acceptance_length")
    assert mean == pytest.approx(1 + accepted / drafts)
    assert "speculative" in json.dumps(info)


def test_analyze_counts_the_rollback_row_from_cache_spec():
    from flashlane.analyze import resolve_model
    from flashlane.analyze.cache import cache_bytes

    flash, std = cache_bytes(resolve_model("glm-5.3-flash").cfg), cache_bytes(resolve_model("glm-5.3").cfg)
    assert flash.draft_rollback == flash.state_per_sequence > 0     # one more state row per running sequence
    assert std.draft_rollback == std.state_per_sequence == 0
