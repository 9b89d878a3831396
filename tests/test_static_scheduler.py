"""Static batching (`scheduler="static"`): greedy outputs equal continuous batching, and the
engine's step records show fixed batches in arrival order with nobody admitted mid-batch."""

from __future__ import annotations

import pytest

from flashlane import LLM, SamplingParams
from flashlane.engine.engine_args import EngineArgs

from engine_models import preset, random_prompts, tiny_llama

N = 4


def _model(name):
    return tiny_llama() if name == "tiny-llama" else preset(name)


def _mixed(m, count, seed):
    """Prompts of mixed lengths and outputs of mixed lengths: batch members finish apart."""
    prompts = random_prompts(count, 20, 200, min(m.config.vocab_size, 4000), seed=seed)
    params = [SamplingParams(max_tokens=3 + 7 * (i % 3), temperature=0, ignore_eos=True) for i in range(count)]
    return prompts, params


def _batch_of_each_step(steps, batches: list[set[str]]) -> list[int]:
    """Index of the batch every step's requests belong to; fails when a step mixes batches
    or runs a request outside all of them."""
    out = []
    for s in steps:
        ids = set(s.request_ids)
        owners = [i for i, b in enumerate(batches) if ids <= b]
        assert len(owners) == 1, f"step {s.step} runs {sorted(ids)}: not inside one batch"
        out.append(owners[0])
    return out


def _arrival_batches(llm, count: int) -> list[set[str]]:
    first = llm._counter - count        # LLM.generate names requests gen-<counter> in arrival order
    ids = [f"gen-{first + i}" for i in range(count)]
    return [set(ids[i:i + N]) for i in range(0, count, N)]


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-llama"])
def test_static_matches_continuous_and_never_admits_mid_batch(name):
    m = _model(name)
    prompts, params = _mixed(m, 10, seed=11)
    continuous = LLM(m, dtype="float32", max_num_seqs=N, max_num_batched_tokens=256)
    ref = continuous.generate(prompts, params)
    static = LLM(m, dtype="float32", scheduler="static", static_batch_size=N, max_num_batched_tokens=256,
                 enable_prefix_caching=False)
    got = static.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]

    steps = list(static.engine.step_stats)
    batches = _arrival_batches(static, len(prompts))
    owner = _batch_of_each_step(steps, batches)
    assert owner == sorted(owner) and set(owner) == set(range(len(batches)))  # one batch after another
    assert static.engine.scheduler.num_batches == len(batches)
    # finished members leave seats empty: some step of the first batch runs fewer than N
    assert any(s.num_seqs < N for s, o in zip(steps, owner) if o == 0)
    # prefills were chunked under the 256-token budget (several prefill steps per batch)
    assert sum(1 for s, o in zip(steps, owner) if o == 0 and s.prefill_tokens) > 1
    # the check can fail: continuous batching with the same running bound refills seats mid-batch
    with pytest.raises(AssertionError):
        _batch_of_each_step(list(continuous.engine.step_stats), _arrival_batches(continuous, len(prompts)))


def test_static_under_preemption_keeps_outputs_and_batches():
    m = preset("tiny-flash")
    prompts = random_prompts(8, 40, 120, 4000, seed=12)
    params = [SamplingParams(max_tokens=30 + 5 * (i % 3), temperature=0, ignore_eos=True) for i in range(8)]
    ref = LLM(m, dtype="float32").generate(prompts, params)
    # 16 pages of 16 tokens cannot hold a batch of 4 as it grows: members are preempted and recomputed
    tight = LLM(m, dtype="float32", scheduler="static", static_batch_size=N, num_pages=16, num_slots=8,
                page_size=16, max_num_batched_tokens=128, enable_prefix_caching=False)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions >= 2
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    steps = list(tight.engine.step_stats)
    assert sum(s.num_preempted for s in steps) == tight.engine.scheduler.num_preemptions
    owner = _batch_of_each_step(steps, _arrival_batches(tight, len(prompts)))
    assert owner == sorted(owner)
    assert tight.engine.cache.usage()["pages_used"] == 0


def test_static_with_prefix_cache_matches_continuous():
    m = preset("tiny-flash")
    shared = random_prompts(1, 130, 130, 4000, seed=13)[0]
    prompts = [shared + p for p in random_prompts(6, 5, 40, 4000, seed=14)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = LLM(m, dtype="float32", enable_prefix_caching=False).generate(prompts, params)
    llm = LLM(m, dtype="float32", scheduler="static", static_batch_size=2)
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert sum(o.num_cached_tokens for o in got) > 0   # later batches reused the shared prefix


def test_static_abort_of_a_member_or_a_queued_request():
    from flashlane.engine.llm_engine import LLMEngine
    m = tiny_llama()
    eng = LLMEngine(m, dtype="float32", scheduler="static", static_batch_size=2)
    for i, p in enumerate(random_prompts(5, 10, 30, 256, seed=15)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    eng.step()
    assert eng.num_running == 2 and eng.num_waiting == 3
    assert eng.abort("r0").finish_reason == "abort"      # a running member: the batch goes on without it
    assert eng.abort("r3").finish_reason == "abort"      # queued for a later batch
    done = []
    while eng.has_unfinished():
        done += [o.request_id for o in eng.step() if o.finished]
    assert done == ["r1", "r2", "r4"]                    # r1 alone, then {r2, r4}
    assert eng.scheduler.num_batches == 2 and eng.cache.usage()["pages_used"] == 0


@pytest.mark.parametrize("kwargs, field", [
    ({"scheduler": "fifo"}, "scheduler"),
    ({"scheduler": "static", "static_batch_size": 0}, "static_batch_size"),
    ({"static_batch_size": 2.5}, "static_batch_size"),
    ({"step_log_size": 0}, "step_log_size"),
    ({"scheduler": "static", "max_wait_ms": 5.0}, "max_wait_ms"),
])
def test_scheduler_args_are_validated(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**kwargs).validate()


def test_cli_flags_reach_the_engine_args():
    import argparse

    from flashlane.cli.engine_flags import add_engine_flags, engine_kwargs
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    kw = engine_kwargs(p.parse_args(["--scheduler", "static", "--static-batch-size", "8"]))
    assert kw["scheduler"] == "static" and kw["static_batch_size"] == 8
    EngineArgs(**kw).validate()
    with pytest.raises(SystemExit):
        p.parse_args(["--scheduler", "fifo"])
    with pytest.raises(SystemExit):
        p.parse_args(["--static-batch-size", "0"])
