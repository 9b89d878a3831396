"""Prefix cache: cached == uncached (greedy ids, prompt logprobs), hit accounting, eviction and
preemption under a tiny pool, checkpoints surviving a partial match, for every architecture."""

from __future__ import annotations

import pytest

from flashlane import LLM, SamplingParams

from engine_models import preset, random_prompts, tiny_llama

TINY = ["tiny-llama", "tiny-flash", "tiny-standard"]
# the real 135M weights in the quicker tests only: the shared-prefix and tiny-pool runs took 84 s
# with them on a 2-core Zen 3 and tiny-llama runs the same llama code paths
MODELS = [*TINY, pytest.param("smollm2-135m", marks=pytest.mark.slow)]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PAGE = 16


def _llm(m, **kw):
    """A float32 engine with a 128 MiB cache unless told otherwise (the default 512 MiB, zeroed,
    times a dozen engines per test made this file peak at 8.6 GB RSS)."""
    return LLM(m, **{"dtype": "float32", "cache_memory": 128 << 20, **kw})


def _model(name):
    return tiny_llama() if name == "tiny-llama" else preset(name)


def _vocab(m) -> int:
    return min(m.config.vocab_size, 4000)


def _pair(m, **kw):
    """The same engine configuration with the prefix cache on and off."""
    return _llm(m, **kw), _llm(m, enable_prefix_caching=False, **kw)


def _idle(llm):
    usage = llm.engine.cache.usage()
    assert usage["pages_used"] == 0 and usage["slots_used"] == 0, usage
    return usage


def _conversation(llm, first: list[int], turns: int, extra: list[list[int]], params=GREEDY):
    """Each turn's prompt is the previous prompt + its output + new tokens (an agentic session)."""
    prompt, outs = list(first), []
    for t in range(turns):
        out = llm.generate([prompt], params)[0]
        outs.append(out)
        prompt = prompt + out.token_ids + extra[t]
    return outs


@pytest.mark.parametrize("name", TINY)
def test_shared_system_prefix_together_and_alone(name):
    m = _model(name)
    system = random_prompts(1, 200, 200, _vocab(m), seed=11)[0]
    tails = random_prompts(16, 3, 40, _vocab(m), seed=12)
    prompts = [system + t for t in tails]
    cached, plain = _pair(m, max_num_batched_tokens=256)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    together = cached.generate(prompts, GREEDY)
    alone = [cached.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in together] == want
    assert [o.token_ids for o in alone] == want
    # one by one, every request after the first reuses the shared system prompt (page-rounded)
    assert all(o.num_cached_tokens >= 192 for o in alone)
    _idle(cached)


@pytest.mark.parametrize("name", MODELS)
def test_multi_turn_hits_what_is_reusable(name):
    m = _model(name)
    first = random_prompts(1, 90, 90, _vocab(m), seed=21)[0]
    extra = random_prompts(6, 5, 30, _vocab(m), seed=22)
    cached, plain = _pair(m)
    got = _conversation(cached, first, 6, extra)
    want = _conversation(plain, first, 6, extra)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    reusable = 0
    for k in range(1, 6):
        prev = got[k - 1]
        # the previous turn computed prompt + output except its last sampled token
        computed = len(prev.prompt_token_ids) + len(prev.token_ids) - 1
        theory = computed // PAGE * PAGE
        assert got[k].num_cached_tokens == theory, (k, got[k].num_cached_tokens, theory)
        reusable += theory
    assert sum(o.num_cached_tokens for o in got) == reusable
    assert all(o.num_cached_tokens == 0 for o in want)
    _idle(cached)


@pytest.mark.parametrize("name", MODELS)
def test_same_prompt_twice_hits_all_but_one_page(name):
    m = _model(name)
    for length in (160, 173):                      # page-aligned and mid-page
        prompt = random_prompts(1, length, length, _vocab(m), seed=length)[0]
        cached, plain = _pair(m)
        a, b = cached.generate([prompt], GREEDY)[0], cached.generate([prompt], GREEDY)[0]
        assert a.num_cached_tokens == 0
        assert b.num_cached_tokens >= length - PAGE
        assert a.token_ids == b.token_ids == plain.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-flash", "tiny-standard"])
def test_logprobs_after_a_hit_and_prompt_logprobs_that_bypass_it_match(name):
    m = _model(name)
    base = random_prompts(1, 150, 150, _vocab(m), seed=31)[0]
    # a mid-page and (for kpool 4) mid-pool divergence: the tail rule fires on the suffix
    second = base[:123] + random_prompts(1, 45, 45, _vocab(m), seed=32)[0]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    cached, plain = _pair(m)
    cached.generate([base], params)
    cached.generate([base[:123] + [5, 6, 7]], params)       # checkpoint at the shared boundary
    hit = cached.generate([second], params)[0]
    ref = plain.generate([second], params)[0]
    assert hit.num_cached_tokens == 112 and hit.token_ids == ref.token_ids
    assert max(abs(a[t] - b[t]) for a, b, t in zip(hit.logprobs, ref.logprobs, ref.token_ids)) <= 1e-4
    # prompt logprobs read nothing from the cache: every position is computed
    scored = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    full = cached.generate([second], scored)[0]
    want = plain.generate([second], scored)[0]
    assert full.num_cached_tokens == 0 and full.prompt_logprobs[0] is None
    assert max(abs(a[t] - b[t]) for a, b, t in zip(full.prompt_logprobs[1:], want.prompt_logprobs[1:],
                                                    second[1:])) <= 1e-4


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-flash", "tiny-standard"])
def test_partial_match_keeps_the_checkpoint(name):
    """A cached; B shares a prefix of A that ends mid-page; C = that shared prefix + other tokens.
    C must hit the shared prefix (B's lookup marked it for a checkpoint), page-rounded."""
    m = _model(name)
    v = _vocab(m)
    a = random_prompts(1, 200, 200, v, seed=41)[0]
    b = a[:101] + random_prompts(1, 60, 60, v, seed=42)[0]
    c = a[:101] + random_prompts(1, 30, 30, v, seed=43)[0]
    cached, plain = _pair(m)
    outs = [cached.generate([p], GREEDY)[0] for p in (a, b, c)]
    assert outs[2].num_cached_tokens == 96
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate([a, b, c], GREEDY)]


@pytest.mark.parametrize("name", TINY)
def test_tiny_pool_evicts_and_preempts_with_identical_outputs(name):
    m = _model(name)
    v = _vocab(m)
    system = random_prompts(1, 100, 100, v, seed=51)[0]
    prompts = [system + t for t in random_prompts(10, 10, 60, v, seed=52)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in _llm(m, enable_prefix_caching=False).generate(prompts, params)]
    tight = _llm(m, num_pages=24, num_slots=6, num_checkpoints=3, max_num_batched_tokens=128)
    for _ in range(2):                              # the second round hits what survived the first
        got = tight.generate(prompts, params)
        assert [o.token_ids for o in got] == want
    stats = tight.engine.stats()
    assert tight.engine.scheduler.num_preemptions >= 2
    assert stats["prefix_cache_page_evictions"] > 0 and stats["prefix_cache_hits"] > 0
    # a multi-turn session through the same tiny pool
    extra = random_prompts(5, 5, 20, v, seed=53)
    got = _conversation(tight, prompts[0][:60], 5, extra, params)
    plain = _llm(m, enable_prefix_caching=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in _conversation(plain, prompts[0][:60], 5, extra, params)]
    usage = _idle(tight)
    assert usage["pages_cached"] > 0


def test_prefix_cache_off_reports_nothing_cached():
    m = tiny_llama()
    llm = _llm(m, enable_prefix_caching=False)
    p = random_prompts(1, 100, 100, 256, seed=61)[0]
    assert [llm.generate([p], GREEDY)[0].num_cached_tokens for _ in range(2)] == [0, 0]
    assert llm.engine.cache.usage()["pages_cached"] == 0
