import json
from pathlib import Path

import pytest

from flashlane.bench.workloads.agentic import SCALES, agentic_source, generate_trace, spec_from_scale
from flashlane.bench.workloads.fixed import FixedSpec, fixed_source
from flashlane.bench.workloads.model import Spawn, Turn
from flashlane.bench.workloads.multiturn import MultiTurnSpec, multiturn_source
from flashlane.bench.workloads.source import cycling_draw
from flashlane.bench.workloads.trace_import import TraceError, load_traces, parse_agentx

SAMPLE = str(Path(__file__).parent / "data" / "agentx-sample-trace.json")


def test_agentx_sample_turn_structure_join_and_think_times():
    (tr,) = load_traces(SAMPLE)
    assert tr.trace_id == "demo_0001" and tr.block_size == 64 and tr.hash_id_scope == "local"
    steps = tr.root.steps
    assert [type(s).__name__ for s in steps] == ["Turn", "Spawn", "Turn", "Turn"]
    t0, sp, t1, t2 = steps
    assert (t0.input_tokens, t0.output_tokens, t0.hash_ids) == (256, 16, [1, 2, 3, 4])
    assert sp.agent_id == "agent_001" and sp.delay_s == pytest.approx(1.0) and sp.gating
    # the sub-agent ended at 1.0 + 2000 ms = 3.0 < 5.0: the parent turn at t=5 joins it and its
    # think gap starts from the sub-agent's end
    assert t1.joins == ["agent_001"] and t1.think_s == pytest.approx(2.0)
    assert t2.joins == [] and t2.think_s == pytest.approx(3.0)
    sub = sp.session
    assert sub.session_id == "root/agent_001" and sub.agent_type == "Explore"
    assert [(t.input_tokens, t.think_s) for t in sub.turns] == [(128, 0.5), (192, 1.0)]
    assert tr.num_requests == 5


def test_background_subagent_gates_nothing_and_api_time_shifts_reference():
    d = json.load(open(SAMPLE))
    d["requests"][1]["status"] = "background"
    d["requests"][0]["api_time"] = 0.4
    tr = parse_agentx(d)
    t0, sp, t1, _ = tr.root.steps
    assert not sp.gating and t1.joins == []
    assert sp.delay_s == pytest.approx(0.6)  # spawn at 1.0, previous turn ended at 0.4
    assert t1.think_s == pytest.approx(4.6)
    d["requests"][2]["think_time"] = 0.25
    assert parse_agentx(d).root.steps[2].think_s == 0.25


def test_subagent_still_running_at_next_turn_is_not_joined():
    d = json.load(open(SAMPLE))
    d["requests"][1]["duration_ms"] = 6000  # ends at 7.0: after the t=5 turn, before t=8
    t1, t2 = [s for s in parse_agentx(d).root.steps if isinstance(s, Turn)][1:]
    assert t1.joins == [] and t2.joins == ["agent_001"]
    assert t2.think_s == pytest.approx(1.0)  # 8.0 - max(5.0, 7.0)


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["requests"][0].pop("in"), "requests[0].in"),
    (lambda d: d["requests"][0].update(out=-3), "requests[0].out"),
    (lambda d: d["requests"][0].update(t="soon"), "requests[0].t"),
    (lambda d: d.update(hash_id_scope="planet"), "hash_id_scope"),
    (lambda d: d["requests"][1].pop("requests"), "requests[1].requests"),
    (lambda d: d.update(requests=[]), "requests"),
])
def test_bad_agentx_fields_are_named(mutate, field):
    d = json.load(open(SAMPLE))
    mutate(d)
    with pytest.raises(TraceError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_agentx(d, where="t")


def test_trace_file_formats(tmp_path):
    one = json.load(open(SAMPLE))
    (tmp_path / "list.json").write_text(json.dumps([one, dict(one, id="b")]))
    assert [t.trace_id for t in load_traces(tmp_path / "list.json")] == ["demo_0001", "b"]
    (tmp_path / "x.jsonl").write_text(json.dumps(one) + "\n" + json.dumps(dict(one, id="c")) + "\n")
    assert len(load_traces(tmp_path / "x.jsonl")) == 2
    (tmp_path / "moon.jsonl").write_text(
        '{"timestamp": 0, "input_length": 700, "output_length": 20, "hash_ids": [1, 2]}\n'
        '{"timestamp": 1500, "input_length": 900, "output_length": 5, "hash_ids": [1, 2, 3]}\n')
    moon = load_traces(tmp_path / "moon.jsonl")
    assert [(t.root.turns[0].input_tokens, t.root.turns[0].t) for t in moon] == [(700, 0.0), (900, 1.5)]
    (tmp_path / "lo.json").write_text(json.dumps(
        {"group": "g", "stream": 1, "prompt_len": 100, "out_lens": [10, 20, 30], "obs_lens": [5, 7],
         "tool_times": [0.5, 1.5]}))
    (lo,) = load_traces(tmp_path / "lo.json")
    assert [(t.input_tokens, t.output_tokens, t.think_s) for t in lo.root.turns] == \
        [(100, 10, 0.0), (115, 20, 0.5), (142, 30, 1.5)]
    (tmp_path / "bad.json").write_text('{"foo": 1}')
    with pytest.raises(TraceError, match="unknown format"):
        load_traces(tmp_path / "bad.json")
    with pytest.raises(TraceError, match="not found"):
        load_traces(tmp_path / "missing.json")


def _check_growing_structure(tr, spec):
    for sess in tr.root.walk():
        turns = sess.turns
        for a, b in zip(turns, turns[1:]):
            assert b.input_tokens >= a.input_tokens + a.output_tokens  # context only grows
            common = 0
            for x, y in zip(a.hash_ids, b.hash_ids):
                if x != y:
                    break
                common += 1
            assert common >= len(a.hash_ids) - 1  # the shared prefix is reused
        for t in turns:
            assert t.input_tokens + t.output_tokens <= spec.max_context_tokens
            assert len(t.hash_ids) == -(-t.input_tokens // spec.block_size)


def test_synthetic_agentic_generator_is_seeded_and_in_agentx_format():
    spec = SCALES["medium"]
    a = generate_trace(spec, seed=7, index=3)
    assert a == generate_trace(spec, seed=7, index=3)
    assert a != generate_trace(spec, seed=8, index=3)
    src = agentic_source(seed=7, spec=spec)
    n_spawns = 0
    for i in range(40):
        tr = src.trace(i)
        _check_growing_structure(tr, spec)
        n_spawns += sum(len(s.spawns) for s in tr.root.walk())
        assert tr.root.system_tokens == spec.system_tokens
    assert n_spawns > 0  # sub-agents do appear
    gating = [sp.gating for i in range(40) for sp in src.trace(i).root.spawns]
    assert any(gating)
    with pytest.raises(ValueError, match="scale"):
        spec_from_scale("galactic")
    assert spec_from_scale("small", turns=(5, 5)).turns == (5, 5)
    with pytest.raises(ValueError, match="nope"):
        spec_from_scale("small", nope=1)


def test_multiturn_shared_prefix_blocks_and_fixed_lengths():
    spec = MultiTurnSpec(turns=3, shared_prefix_tokens=128, first_user_tokens=40,
                         user_tokens_per_turn=30, output_tokens=(8, 8), think="fixed", think_mean_s=0.2)
    src = multiturn_source(1, spec)
    a, b = src.trace(0), src.trace(1)
    assert a.hash_id_scope == "global"
    assert a.root.turns[0].hash_ids[:2] == b.root.turns[0].hash_ids[:2] == [1, 2]
    assert set(a.root.turns[0].hash_ids[2:]).isdisjoint(b.root.turns[0].hash_ids[2:])
    assert [t.input_tokens for t in a.root.turns] == [168, 206, 244]
    assert [t.think_s for t in a.root.turns] == [0.0, 0.2, 0.2]
    with pytest.raises(ValueError, match="think"):
        multiturn_source(1, MultiTurnSpec(think="weird"))
    f = fixed_source(0, FixedSpec(100, 20, 0.5))
    lens = [(f.trace(i).root.turns[0].input_tokens, f.trace(i).root.turns[0].output_tokens) for i in range(50)]
    assert all(50 <= i <= 150 and 10 <= o <= 30 for i, o in lens) and len(set(lens)) > 1
    with pytest.raises(ValueError, match="range_ratio"):
        fixed_source(0, FixedSpec(100, 20, 1.5))


def test_cycling_draw_is_a_seeded_permutation_per_epoch():
    traces = load_traces(SAMPLE) * 1
    d = json.load(open(SAMPLE))
    traces = [parse_agentx(dict(d, id=f"t{i}")) for i in range(5)]
    draw = cycling_draw(traces, seed=3)
    first = [draw(i).trace_id for i in range(5)]
    assert sorted(first) == [f"t{i}" for i in range(5)]
    assert [draw(i).trace_id for i in range(5)] == first
    assert sorted(draw(i).trace_id for i in range(5, 10)) == sorted(first)
    assert isinstance(traces[0].root.steps[1], Spawn)
