"""Speculative decoding with the models' own MTP layer (GLM): greedy token ids equal speculation
off under batching, chunked prefill, preemption and prefix-cache hits; the drafts equal one plain
forward of the target and the MTP layer over the whole sequence (whatever chunking, paging,
prefix hits and chained steps the engine went through); synthetic acceptance reaches the asked
mean length and says so; bad configurations are refused by name."""

from __future__ import annotations

import pytest
import torch

from flashlane import LLM, SamplingParams
from flashlane.cache_spec import cache_spec
from flashlane.engine.cache.pools import allocate_pools
from flashlane.engine.speculative import SpeculativeConfig
from flashlane.engine.speculative.config import synthetic_rate
from flashlane.models.forward_batch import ForwardBatch

from engine_models import preset, random_prompts, small_glm, tiny_llama
from test_speculative import _Oracle, _prompts, check_prefix_hit_then_rejection

# the presets, and hidden configs: other depths, layer patterns, kpool and hc_mult than the presets
MODELS = ["tiny-flash", "tiny-standard", "small-glm5_next", "small-glm5_next-kpool2-hc2", "small-glm_moe_dsa"]


def _model(name):
    if name == "small-glm5_next-kpool2-hc2":
        return small_glm("glm5_next", seed=5, mtp=True, index_kpool=2, hc_mult=2, index_topk=6)
    if name.startswith("small-"):
        return small_glm(name[len("small-"):], seed=4, mtp=True)
    return preset(name)


def _llm(m, k: int | None = None, **kw):
    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k}
    return LLM(m, **{"dtype": "float32", "cache_memory": 64 << 20, "speculative_config": spec, **kw})


class _MtpOracle(_Oracle):
    """The MTP layer still runs every step (its cache kept, its drafts made); the drafts the
    scheduler hands out are the oracle's, so verification accepts every length 0..k."""

    def __init__(self, refs, k):
        super().__init__(refs, k)
        self.lookahead = k


def _with_oracle(llm, prompts, outputs, k):
    llm.engine.scheduler.drafter = _MtpOracle({tuple(p): list(o) for p, o in zip(prompts, outputs)}, k)
    return llm


def _drafted(llm):
    s = llm.engine.stats()
    return s.get("spec_draft_tokens", 0), s.get("spec_accepted_tokens", 0)


# ---- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize("value, field", [
    ({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "fast"},
     "speculative_config.rejection_sample_method"),
    ({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"},
     "speculative_config.synthetic_acceptance_length"),
    ({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 4.5}, "speculative_config.synthetic_acceptance_length"),
    ({"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_length": 0.5}, "speculative_config.synthetic_acceptance_length"),
    ({"method": "mtp", "num_speculative_tokens": 3, "synthetic_acceptance_length": 2.0},
     "speculative_config.synthetic_acceptance_length"),
])
def test_bad_configuration_names_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SpeculativeConfig.parse(value)


def test_mtp_on_a_model_without_mtp_layers_is_refused():
    with pytest.raises(ValueError, match=r"speculative_config\.method 'mtp'.*no"):
        _llm(tiny_llama(), 2)
    with pytest.raises(ValueError, match=r"speculative_config\.method 'mtp'.*no"):
        _llm(small_glm("glm5_next", seed=4, mtp=False), 2)


def test_synthetic_rate_gives_the_mean_length():
    for k, length in ((3, 2.99), (1, 1.5), (4, 1.0), (2, 3.0)):
        p = synthetic_rate(length, k)
        assert 0 <= p <= 1 and sum(p ** i for i in range(k + 1)) == pytest.approx(length, abs=1e-9)


# ---- the cache holds the MTP layer's rows ---------------------------------------------------------
def test_cache_spec_counts_the_mtp_layer():
    cfg = preset("tiny-flash").config
    off, on = cache_spec(cfg, 16), cache_spec(cfg, 16, mtp=True)
    assert on.latent_layers == off.latent_layers + (cfg.num_layers,)
    assert on.index_row(cfg.num_layers) == len(off.index_layers)
    per_token = on.bytes_per_token("float32") - off.bytes_per_token("float32")
    assert per_token == pytest.approx(on.mtp_bytes_per_token("float32")) and per_token > 0
    assert on.bytes_per_slot("float32") - off.bytes_per_slot("float32") == on.tail_bytes_per_sequence("float32") \
        - off.tail_bytes_per_sequence("float32") > 0      # the MTP layer's indexer tail
    assert on.layout_key() != off.layout_key()
    with pytest.raises(ValueError, match="no MTP layers"):
        cache_spec(tiny_llama().config, 16, mtp=True)
    llm = _llm(preset("tiny-flash"), 2)
    info = llm.engine.info
    assert info.speculative["method"] == "mtp"
    assert info.speculative["mtp_bytes_per_token"] == pytest.approx(on.mtp_bytes_per_token("float32"))
    assert "speculative decoding mtp k=2 (MTP layer" in llm.engine.describe_cache()


# ---- exactness ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("k", [1, 4])
def test_ids_equal_speculation_off_batched_and_chunked(name, k):
    m = _model(name)
    prompts = _prompts(m, 5, seed=k)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in _llm(m, max_num_batched_tokens=64).generate(prompts, params)]
    own = _llm(m, k, max_num_batched_tokens=64)          # the MTP layer's own drafts
    assert [o.token_ids for o in own.generate(prompts, params)] == want
    assert _drafted(own)[0] > 0
    spec = _with_oracle(_llm(m, k, max_num_batched_tokens=64), prompts, want, k)
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    drafted, accepted = _drafted(spec)
    assert 0 < accepted < drafted
    usage = spec.engine.cache.usage()
    assert usage["pages_used"] == 0 and usage["slots_used"] == 0


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard"])
def test_ids_equal_under_preemption(name):
    m = _model(name)
    prompts = _prompts(m, 8, seed=31)
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)] * 4
    want = [o.token_ids for o in _llm(m, enable_prefix_caching=False).generate(prompts, params)]
    tight = _with_oracle(_llm(m, 3, num_pages=30, num_slots=6, max_num_batched_tokens=128,
                              enable_prefix_caching=False), prompts, want, 3)
    assert [o.token_ids for o in tight.generate(prompts, params)] == want
    assert tight.engine.scheduler.num_preemptions >= 1
    assert _drafted(tight)[1] > 0


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard", "small-glm5_next-kpool2-hc2"])
def test_prefix_hit_then_rejection_matches_plain(name):
    """vLLM #43559 with MTP: after a prefix-cache hit, partly rejected drafts leave every state
    (the target's and the MTP layer's) where the accepted tokens put them."""
    m = _model(name)
    check_prefix_hit_then_rejection(m, _llm(m), lambda prompts, outs: _with_oracle(_llm(m, 3), prompts, outs, 3))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["small-glm5_next-kpool2-hc2", "small-glm_moe_dsa"])
def test_static_graphs_draft_and_verify_with_the_ids_of_speculation_off(name):
    """With static graphs the MTP layer drafts through a compiled region of its own (the catch-up
    as decode rows where it keeps no per-sequence state, the chained steps always) and verify
    steps run in graphs; greedy ids equal the eager engine without speculation, with the MTP
    layer's own drafts and with an oracle's (both kept and rejected)."""
    m = _model(name)
    k = 3
    prompts = _prompts(m, 3, seed=41)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in _llm(m).generate(prompts, params)]
    llm = _llm(m, k, compile=True, compile_sizes=(4,), max_num_seqs=4)
    graphs = llm.engine.runner.compiled
    assert graphs.mtp and llm.engine.info.speculative["verify_in_graphs"]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want          # the MTP layer's drafts
    assert graphs.draft_calls > 0
    _with_oracle(llm, prompts, want, k)
    before = sum(graphs.calls.values())
    shapes = []                           # tokens per sequence of each compiled MTP pass
    draft = graphs.draft
    graphs.draft = lambda batch, hidden: shapes.append(batch.rows_per_seq) or draft(batch, hidden)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    drafted, accepted = _drafted(llm)
    assert 0 < accepted < drafted
    assert sum(graphs.calls.values()) > before
    # accepted drafts leave several committed tokens to catch up on: with the indexer tail
    # (kpool 2) they run q tokens per sequence in order, without it one row per token
    assert (max(shapes) > 1) == (m.config.index_kpool > 1), shapes


# ---- the drafts themselves ------------------------------------------------------------------------
def _reference_drafts(model, cfg, tokens: list[int], k: int) -> list[int]:
    """Spec §1.10 by one plain forward: the target over ``tokens[:-1]`` (all computed positions),
    the MTP layer over the same positions with each next token, then k-1 chained MTP steps, in a
    fresh cache of one sequence."""
    spec = cache_spec(cfg, 16, mtp=True)
    n = len(tokens) - 1
    pages = -(-(n + k) // 16)
    cache = allocate_pools(spec, pages + 1, 2, torch.float32)
    table = list(range(1, pages + 1))

    def batch(ids, start):
        return ForwardBatch.build([ids], [start], [table], [1 if spec.needs_state_slot else 0], cache)

    with torch.inference_mode():
        hidden = model(batch(tokens[:n], 0))
        h = model.mtp(batch(tokens[1: n + 1], 0), hidden)[-1:]
        drafts = [int(model.compute_logits(h).argmax())]
        for j in range(1, k):
            h = model.mtp(batch([drafts[-1]], n + j - 1), h)
            drafts.append(int(model.compute_logits(h).argmax()))
    return drafts


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard", "small-glm5_next-kpool2-hc2"])
def test_drafts_equal_one_plain_forward_through_chunks_steps_and_prefix_hits(name):
    m = _model(name)
    k = 3
    llm = _llm(m, k, max_num_batched_tokens=64)
    v = min(m.config.vocab_size, 4000)
    prompt = random_prompts(1, 40, 40, v, seed=13)[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params)[0].token_ids
    # the second request shares the first's three pages (a checkpoint at 48 from its decode), then
    # goes elsewhere: the MTP row at the hit's last position must be recomputed with the new next token
    second = (prompt + first)[:48] + [(t + 7) % (v - 3) + 3 for t in first[8:]] + prompt[:10]
    checked = full = 0
    for rid, p in (("a", prompt), ("b", second)):
        req = llm.engine.add_request(rid, p, params)
        while not req.finished:
            llm.engine.step()
            if req.draft_token_ids and not req.finished:
                assert req.num_computed_tokens == req.num_tokens - 1
                drafts = req.draft_token_ids      # (fewer than k near max_tokens)
                assert drafts == _reference_drafts(m.model, m.config, req.all_token_ids, k)[: len(drafts)]
                checked += 1
                full += len(drafts) == k
    assert req.num_cached_tokens == 48
    assert checked >= 10 and full >= 10
    assert llm.generate([prompt], params)[0].token_ids == first


# ---- synthetic acceptance -------------------------------------------------------------------------
def test_synthetic_acceptance_reaches_the_mean_length_and_says_so():
    m = preset("tiny-flash")
    spec = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 2.5}
    llm = LLM(m, dtype="float32", cache_memory=64 << 20, speculative_config=spec)
    prompts = _prompts(m, 4, seed=3)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 120 for o in outs)
    s = llm.engine.stats()
    mean = 1 + s["spec_accepted_tokens"] / s["spec_drafts"]
    assert s["spec_drafts"] > 100 and abs(mean - 2.5) < 0.25, (mean, s)
    assert "SYNTHETIC" in llm.engine.describe_cache()
    assert llm.engine.info.speculative["rejection_sample_method"] == "synthetic"
    # a seeded sampled request is reproducible under synthetic acceptance too
    sampled = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    assert llm.generate(prompts[:1], sampled)[0].token_ids == llm.generate(prompts[:1], sampled)[0].token_ids

