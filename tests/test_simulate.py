"""The simulated engine makes the engine's own scheduling decisions: on the same requests and
engine arguments, the sequence of step compositions (which requests, how many new tokens after
how many cached ones, preemptions) equals a real engine run's step records, including chunked
prefill, preemption under a small cache and prefix-cache hits (with state checkpoints for the
hybrid). Its time is the step-cost model's: a step lasts exactly what the cost says."""

from __future__ import annotations

import random

import pytest

from flashlane.analyze.step_cost import StepShape
from flashlane.engine.llm_engine import LLMEngine
from flashlane.engine.sampling_params import SamplingParams
from flashlane.simulate.sim_engine import SimEngine

from engine_models import preset, tiny_llama


def _waves(vocab: int, seed: int = 0) -> list[list[tuple[str, list[int], int]]]:
    """Two waves of requests: the second shares long prefixes with the first (prefix hits)."""
    rng = random.Random(seed)
    first = [(f"a{i}", [rng.randrange(3, vocab) for _ in range(n)], out)
             for i, (n, out) in enumerate(((150, 5), (70, 9), (200, 3), (33, 6)))]
    second = [(f"b{i}", p[:len(p) - 10] + [rng.randrange(3, vocab) for _ in range(40)], 4)
              for i, (_, p, _) in enumerate(first[:3])]
    return [first, second]


def _compositions(steps) -> list[tuple]:
    return [(tuple(s.request_ids), tuple(s.seq_new_tokens), tuple(s.seq_cached_tokens), s.num_preempted)
            for s in steps]


def _real_steps(name: str, waves, **args) -> list:
    """The step records of a real engine run over ``waves``, each wave after the last finished."""
    engine = LLMEngine(preset(name), **args)
    for wave in waves:
        for rid, prompt, out in wave:
            engine.add_request(rid, prompt, SamplingParams(max_tokens=out, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    return list(engine.step_stats)


def _real(name: str, waves, **args) -> list[tuple]:
    return _compositions(_real_steps(name, waves, **args))


def _simulated(name: str, waves, cost=lambda shape: 1.0, **args):
    engine = SimEngine(preset(name).config, cost, dtype="float32", **args)
    steps = []
    for wave in waves:
        for rid, prompt, out in wave:
            engine.add_request(rid, prompt, out)
        while engine.has_work:
            step = engine.step()
            assert step is not None     # no admission window in these runs: every pass schedules
            steps.append(step)
    return engine, steps


ARGS = {
    "roomy": dict(max_num_batched_tokens=64, num_pages=64, max_num_seqs=4),
    "preempting": dict(max_num_batched_tokens=64, num_pages=14, max_num_seqs=4),
    "static": dict(max_num_batched_tokens=128, num_pages=64, max_num_seqs=4, scheduler="static",
                   static_batch_size=2, enable_prefix_caching=False),
}


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard"])
@pytest.mark.parametrize("case", sorted(ARGS))
def test_the_simulator_schedules_exactly_as_the_engine(name, case):
    args = {"dtype": "float32", "page_size": 16, "num_threads": 1, **ARGS[case]}
    vocab = preset(name).config.vocab_size
    waves = _waves(vocab)
    if case == "preempting":   # four 50-token prompts fit; their 30-token outputs do not
        rng = random.Random(1)
        waves = [[(f"p{i}", [rng.randrange(3, vocab) for _ in range(50)], 30) for i in range(4)]]
    real = _real(name, waves, **args)
    _, steps = _simulated(name, waves, **{k: v for k, v in args.items() if k not in ("dtype", "num_threads")})
    assert _compositions(steps) == real
    if case == "preempting":
        assert any(c[3] for c in real), "the small cache must preempt someone"
    if case == "roomy":
        # the second wave starts after cached prefixes (prefix hits, incl. state checkpoints for the hybrid)
        assert any(rid.startswith("b") and cached > 0 and new > 1
                   for ids, news, cacheds, _ in real for rid, new, cached in zip(ids, news, cacheds))


def _with_drafts(steps) -> list[tuple]:
    """Compositions plus each step's verified drafts and its MTP pass (calls, rows, drafted rows)."""
    return [(tuple(s.request_ids), tuple(s.seq_new_tokens), tuple(s.seq_cached_tokens), s.num_preempted,
             tuple(s.seq_draft_tokens), s.draft_calls, s.draft_rows, s.draft_logit_rows) for s in steps]


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard"])
@pytest.mark.parametrize("length", [1.0, 4.0])
@pytest.mark.parametrize("case", ["roomy", "preempting"])
def test_the_simulator_drafts_verifies_and_passes_the_mtp_layer_as_the_engine(name, length, case):
    """MTP with k = 3 at synthetic acceptance 1 (every draft rejected) and 4 (every draft kept),
    the two lengths whose draws are certain: the same steps, the same drafts verified in each,
    the same MTP layer calls, rows and drafted rows after each, beside chunked prefill, prefix
    hits (the MTP layer's recomputed row) and preemption."""
    spec = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": length}
    args = {"page_size": 16, **ARGS[case], "speculative_config": spec}
    vocab = preset(name).config.vocab_size
    waves = _waves(vocab)
    if case == "preempting":
        rng = random.Random(1)
        waves = [[(f"p{i}", [rng.randrange(3, vocab) for _ in range(50)], 30) for i in range(4)]]
    real = _real_steps(name, waves, dtype="float32", num_threads=1, **args)
    _, steps = _simulated(name, waves, **args)
    assert _with_drafts(steps) == _with_drafts(real)
    assert sum(sum(r.seq_draft_tokens) for r in real) > 0 and all(r.draft_calls for r in real)
    if length == 4.0:
        assert sum(r.accepted_tokens for r in real) == sum(r.draft_tokens for r in real)
    if case == "roomy":
        redo = [s for s in steps if any(rid.startswith("b") and c > 0 for rid, c in zip(s.request_ids,
                                                                                      s.seq_cached_tokens))]
        assert redo, "the second wave must start after a prefix hit"
    # what the simulator prices: the verify rows and the MTP pass of each step
    shapes = [StepShape.from_record(r.to_json()) for r in real]
    assert any(sh.verify for sh in shapes) and all(sh.draft_calls >= 1 for sh in shapes)


def test_simulated_time_is_the_sum_of_the_step_costs():
    waves = _waves(preset("tiny-flash").config.vocab_size)
    seen = []

    def price(shape: StepShape) -> float:
        return 0.001 * shape.num_tokens + 0.01 * len(shape.decode)

    def cost(shape: StepShape) -> float:
        seen.append(shape)
        return price(shape)

    engine, steps = _simulated("tiny-flash", waves, cost=cost, max_num_batched_tokens=64, num_pages=64, page_size=16)
    assert len(seen) == len(steps)
    for s, shape in zip(steps, seen):
        assert s.duration == pytest.approx(price(shape))
        assert shape.num_tokens == sum(s.seq_new_tokens)
    assert all(a.end == b.start for a, b in zip(steps, steps[1:]))     # back to back: nothing idles
    assert engine.now == pytest.approx(sum(price(sh) for sh in seen))
    finished = [rid for s in steps for rid in s.finished]
    assert sorted(finished) == sorted(rid for w in waves for rid, _, _ in w) and not engine.requests


def test_the_simulator_refuses_what_it_does_not_model():
    cfg = preset("tiny-flash").config
    with pytest.raises(ValueError, match="host_cache_memory"):
        SimEngine(cfg, lambda s: 1.0, host_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="dtype"):
        SimEngine(cfg, lambda s: 1.0, dtype="int4")
    engine = SimEngine(cfg, lambda s: 1.0, num_pages=8, page_size=16)
    with pytest.raises(ValueError, match="do not fit"):
        engine.add_request("x", list(range(3, 200)), 4)
    engine.add_request("y", [5, 6, 7], 2)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("y", [5, 6, 7], 2)
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="synthetic_acceptance_length"):      # no logits to verify against
        SimEngine(cfg, lambda s: 1.0, speculative_config=mtp)
    with pytest.raises(ValueError, match="method 'ngram'"):                   # drafts from text it has not
        SimEngine(cfg, lambda s: 1.0, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                         "rejection_sample_method": "synthetic",
                                                         "synthetic_acceptance_length": 2.0})
    with pytest.raises(ValueError, match="MTP layer"):
        SimEngine(tiny_llama().config, lambda s: 1.0, speculative_config={
            **mtp, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.0})


def test_simulated_acceptance_has_the_given_mean_length():
    """At acceptance 2.2 with k = 3 the tokens a verify step gives average 2.2 (a seeded draw)."""
    cfg = preset("tiny-standard").config
    spec = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 2.2}
    engine = SimEngine(cfg, lambda s: 1.0, page_size=16, num_pages=512, max_num_seqs=8, speculative_config=spec)
    for i in range(8):
        engine.add_request(f"r{i}", list(range(3, 40)), 400)
    gained = []
    while engine.has_work:
        step = engine.step()
        verified = {rid for rid, d in zip(step.request_ids, step.seq_draft_tokens) if d == 3}
        gained += [n for rid, n in zip(step.sampled, step.sampled_tokens) if rid in verified]
    assert len(gained) > 500
    assert sum(gained) / len(gained) == pytest.approx(2.2, abs=0.08)
