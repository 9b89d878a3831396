"""Static-graph decode (``compile=True``) against the eager engine, for all three architectures.

Greedy tokens must be identical and logprobs within 1e-4 (fp32), at bucket sizes and between
them (a padded bucket); padding rows must never touch a real sequence's cache or outputs.
Compiling costs tens of seconds per model on these CPUs, so the models are small and each
compiled engine is built once per module.
"""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest

from graph_profile import aten_matmuls_inside_graphs, graph_calls
from engine_models import random_prompts, small_glm, tiny_llama
from flashlane.engine.llm import LLM
from flashlane.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
# llama compiles in seconds; a GLM graph takes a minute or more here, so those get one bucket
# (1 and 3 sequences pad up to it). The MoE's few-token branch is tested eagerly in test_kernels_moe.
SIZES = {"llama": (1, 2, 4), "glm5_next": (4,), "glm_moe_dsa": (4,)}


MODELS = {"llama": lambda: tiny_llama(), "glm5_next": lambda: small_glm("glm5_next"),
          "glm_moe_dsa": lambda: small_glm("glm_moe_dsa")}


@functools.lru_cache(maxsize=None)
def _engines(arch: str):
    m = MODELS[arch]()
    kw = dict(dtype="float32", page_size=16, max_num_seqs=8, num_pages=96)
    # the compiled engine caches prefixes, the eager one does not: cached == uncached as well
    return (LLM(m, enable_prefix_caching=False, **kw),
            LLM(m, compile=True, compile_sizes=SIZES[arch], enable_prefix_caching=True, **kw))


def _assert_same(eager_outs, compiled_outs):
    for e, c in zip(eager_outs, compiled_outs):
        assert c.token_ids == e.token_ids
        for le, lc in zip(e.logprobs, c.logprobs):
            assert le.keys() == lc.keys()
            assert max(abs(le[t] - lc[t]) for t in le) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("num_prompts", [1, 3, 4, 6])   # a bucket, between buckets, beyond the largest
def test_compiled_decode_matches_eager(arch, num_prompts):
    eager, compiled = _engines(arch)
    prompts = random_prompts(num_prompts, 3, 70, 250, seed=num_prompts)
    before = dict(compiled.engine.runner.compiled.calls)
    _assert_same(eager.generate(prompts, GREEDY), compiled.generate(prompts, GREEDY))
    calls = {b: n - before[b] for b, n in compiled.engine.runner.compiled.calls.items()}
    decode_steps = GREEDY.max_tokens - 1
    if num_prompts <= max(SIZES[arch]):   # every decode step went through a graph
        assert sum(calls.values()) == decode_steps
    else:                                 # more sequences than the largest bucket: eager
        assert sum(calls.values()) == 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MODELS))
def test_compiled_decode_after_prefix_cache_hits_matches_eager(arch):
    eager, compiled = _engines(arch)
    prompts = random_prompts(3, 40, 70, 250, seed=11)
    compiled.generate(prompts, GREEDY)
    again = compiled.generate(prompts, GREEDY)        # full pages (and state checkpoints) reused
    assert sum(o.num_cached_tokens for o in again) > 0
    _assert_same(eager.generate(prompts, GREEDY), again)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "glm_moe_dsa"])
@pytest.mark.parametrize("num_prompts, k", [(1, 3), (2, 1)])      # 4 rows: a bucket of each arch
def test_drafts_verified_in_the_decode_graphs_keep_the_ids(arch, num_prompts, k):
    """Speculative verify steps (drafts from an oracle that is wrong from a varying position) run
    through the decode graphs, one row per verified token, and the ids equal the eager run's."""
    from test_speculative import _Oracle

    eager, compiled = _engines(arch)
    prompts = random_prompts(num_prompts, 3, 70, 250, seed=20 + k)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    runner, sched = compiled.engine.runner, compiled.engine.scheduler
    steps = []
    fits = runner._fits_graph
    runner._fits_graph = lambda seqs: steps.append((any(s.draft for s in seqs), fits(seqs))) or steps[-1][1]
    sched.drafter = _Oracle({tuple(p): list(o) for p, o in zip(prompts, want)}, k)
    try:
        got = [o.token_ids for o in compiled.generate(prompts, params)]
    finally:
        sched.drafter = None
        del runner._fits_graph
    assert got == want
    verified = [graph for drafts, graph in steps if drafts]
    assert verified and all(verified) and len(steps) < len(prompts) * params.max_tokens   # drafts were kept


@pytest.mark.slow
@pytest.mark.parametrize("num_prompts", [1, 3])      # a bucket, and a padding sequence
def test_drafts_of_a_stateful_model_verify_in_graphs_of_their_own(num_prompts):
    """glm5_next keeps KDA and indexer-tail state, which advances token by token: its verify
    steps run graphs compiled for 1 + k tokens per sequence (a sequence with fewer drafts, or none,
    padded), rejections copy back the state kept after their last accepted token, and the ids (greedy, batched, prefix
    caching on) equal the eager engine's."""
    from test_speculative import _Oracle

    from flashlane.engine.scheduler import ScheduledSeq

    eager = _engines("glm5_next")[0]
    k = 3
    spec = _spec_engine(k)
    runner = spec.engine.runner
    assert runner.compiled.verify_rows == k + 1
    assert runner._fits_graph([ScheduledSeq(SimpleNamespace(), num_new=3, draft=[5, 6])])   # k - 1: padded
    assert not runner._fits_graph([ScheduledSeq(SimpleNamespace(), num_new=3)])                  # a prefill chunk
    prompts = random_prompts(num_prompts, 3, 70, 250, seed=30 + num_prompts)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    spec.engine.scheduler.drafter = _Oracle({tuple(p): list(o) for p, o in zip(prompts, want)}, k)
    steps = []
    fits = runner._fits_graph
    runner._fits_graph = lambda seqs: steps.append((any(s.draft for s in seqs), fits(seqs))) or steps[-1][1]
    try:
        got = [o.token_ids for o in spec.generate(prompts, params)]
    finally:
        del runner._fits_graph
    assert got == want
    assert all(graph for drafts, graph in steps if drafts)
    stats = spec.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]     # kept and rolled back


@functools.lru_cache(maxsize=None)
def _spec_engine(k: int):
    return LLM(MODELS["glm5_next"](), dtype="float32", page_size=16, max_num_seqs=8, num_pages=96, compile=True,
               compile_sizes=SIZES["glm5_next"], enable_prefix_caching=True,
               speculative_config={"method": "ngram", "num_speculative_tokens": k})


@pytest.mark.slow
def test_compiled_int8_engine_stays_close_to_eager_int8():
    kw = dict(dtype="float32", quantization="int8", max_num_seqs=4)
    prompts = random_prompts(3, 5, 40, 250, seed=3)
    # quantization works in place: each engine gets its own copy of the shared model
    eager = LLM(copy.deepcopy(tiny_llama()), **kw).generate(prompts, GREEDY)
    compiled = LLM(copy.deepcopy(tiny_llama()), compile=True, compile_sizes=(4,), **kw).generate(prompts, GREEDY)
    for e, c in zip(eager, compiled):
        assert c.token_ids == e.token_ids
        assert max(abs(le[t] - lc[t]) for le, lc in zip(e.logprobs, c.logprobs) for t in le) < 1e-3


@pytest.mark.slow
def test_batch_one_graphs_multiply_inside_the_graph_not_through_aten_matmuls():
    """The batch-1 decode graphs (CPU_OPTIONS: Inductor's one-row matmul decomposition) make no
    call into aten's mm / addmm, whose fixed cost per call was a third of a tiny model's step; the
    same engine's outputs equal eager ones (test_compiled_decode_matches_eager[llama-1])."""
    from torch.profiler import ProfilerActivity, profile

    compiled = _engines("llama")[1]
    prompt = random_prompts(1, 20, 40, 250, seed=5)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    events = prof.events()
    matmuls = aten_matmuls_inside_graphs(events)
    assert graph_calls(events) and compiled.engine.runner.compiled.calls[1] >= 3
    assert not matmuls, f"{len(matmuls)} aten matmuls inside the batch-1 graphs"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["glm5_next", "glm_moe_dsa"])
def test_glm_batch_one_graphs_match_eager(arch):
    """The GLM models' batch-1 graphs, whose matmuls Inductor decomposes (CPU_OPTIONS), against
    eager: the same tokens, logprobs within 1e-4 (fp32)."""
    m = MODELS[arch]()
    kw = dict(dtype="float32", page_size=16, max_num_seqs=2, num_pages=96, enable_prefix_caching=False)
    prompts = random_prompts(1, 20, 60, 250, seed=31)
    eager = LLM(m, **kw).generate(prompts, GREEDY)
    compiled = LLM(m, compile=True, compile_sizes=(1,), **kw)
    _assert_same(eager, compiled.generate(prompts, GREEDY))
    assert compiled.engine.runner.compiled.calls[1] >= GREEDY.max_tokens - 1


@pytest.mark.slow
def test_compiled_engine_reports_its_buckets_and_warm_up():
    compiled = LLM(tiny_llama(), dtype="float32", compile=True, compile_sizes=[4, 2, 1, 2], max_num_seqs=3)
    info = compiled.engine.info.compiled_decode
    # sorted, de-duplicated, capped at what can run at once
    assert info["sizes"] == [1, 2, 3] and info["warmup_s"] > 0 and info["cache_dir"]
    eng = compiled.engine
    assert not eng.step_stats and not eng.counters and not eng.requests   # warm-up leaves no trace
    assert "compiled decode" in eng.info.describe_compile()


def test_compile_sizes_are_validated():
    for bad in ([], [0], [1, -2], "4", [1.5], [True]):
        with pytest.raises(ValueError, match="compile_sizes"):
            LLM(tiny_llama(), dtype="float32", compile=True, compile_sizes=bad)


def test_compile_sizes_flag():
    import argparse

    from flashlane.cli.engine_flags import add_engine_flags, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    kw = engine_kwargs(p.parse_args(["--compile", "--compile-sizes", "8,1,2"]))
    assert kw["compile"] and kw["compile_sizes"] == (1, 2, 8)
    assert engine_kwargs(p.parse_args([]))["compile_sizes"] == (1, 2, 4, 8, 16)
    for bad in ("1,x", "0", ""):
        with pytest.raises(SystemExit):
            p.parse_args(["--compile-sizes", bad])


@pytest.mark.slow
def test_verify_graphs_need_the_hidden_shape():
    from flashlane.engine.compiled_decode import CompiledDecode

    eng = _engines("glm5_next")[1].engine
    with pytest.raises(ValueError, match="hidden"):
        CompiledDecode(eng.model, eng.cache.tensors, (1,), None, verify_rows=3)
    with pytest.raises(ValueError, match="hidden"):
        CompiledDecode(eng.model, eng.cache.tensors, (1,), None, mtp=True)
