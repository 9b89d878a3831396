"""The step-cost model: its work agrees with analyze (FLOPs of prefill and decode, decode bytes
of the roofline) on tiny and full-size configs, its fit recovers known coefficients, bad inputs
are refused naming what is wrong, and engine step records carry the composition it reads."""

from __future__ import annotations

import random

import pytest

from flashlane.analyze import decode_flops, prefill_flops
from flashlane.analyze.hardware import HARDWARE
from flashlane.analyze.memory import Layout
from flashlane.analyze.models import resolve_model
from flashlane.analyze.roofline import Roofline, Setup
from flashlane.analyze.step_cost import GROUPS, TERMS, StepCostModel, StepShape, StepWork, fit, prefill_m0

CONFIGS = ("tiny-flash", "tiny-standard", "smollm2-135m", "glm-5.3-flash", "glm-5.3")


def _cfg(name: str):
    return resolve_model(name).cfg


@pytest.mark.parametrize("name", CONFIGS)
def test_step_flops_are_analyze_flops(name):
    cfg = _cfg(name)
    work = StepWork(cfg)
    # one prefill chunk after a cached prefix: analyze's prefill (head on the last row only)
    g = work.groups(StepShape(prefill=((777, 3000),)))
    assert sum(x.flops for x in g.values()) == pytest.approx(prefill_flops(cfg, 777, 3000).total, rel=1e-12)
    # a decode batch at mixed contexts: the sum of analyze's per-token decode FLOPs
    ctx = (5, 900, 4097, 20000)
    g = work.groups(StepShape(decode=tuple(c - 1 for c in ctx)))
    assert sum(x.flops for x in g.values()) == pytest.approx(sum(decode_flops(cfg, c).total for c in ctx), rel=1e-12)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_decode_bytes_are_the_roofline_bytes(name, dtype):
    cfg = _cfg(name)
    work = StepWork(cfg, weight_dtype=dtype)
    roof = Roofline(cfg, Setup(HARDWARE["h200"], Layout(tp=1), weight_dtype=dtype))
    for batch, context in ((1, 64), (8, 4096), (32, 100_000)):
        g = work.groups(StepShape(decode=(context - 1,) * batch))
        assert sum(x.bytes for x in g.values()) == pytest.approx(roof.decode_step(batch, context).bytes, rel=1e-9)


def test_groups_split_the_work_by_kind():
    flash, llama = StepWork(_cfg("tiny-flash")), StepWork(_cfg("smollm2-135m"))
    shape = StepShape(prefill=((256, 0),), decode=(1000,))
    assert flash.groups(shape)["recurrence"].flops > 0 and flash.groups(shape)["experts"].flops > 0
    assert llama.groups(shape)["recurrence"] == llama.groups(shape)["experts"] == type(
        llama.groups(shape)["experts"])(0.0, 0.0)
    # routed experts: bytes grow with the distinct experts a step touches, up to all of them
    one, many = (flash.groups(StepShape(decode=(10,) * n))["experts"].bytes for n in (1, 512))
    assert many > 4 * one
    assert flash.distinct_experts(10**6) == pytest.approx(flash.cfg.n_routed_experts)
    # dispatch counts: a prefill sequence adds work in every layer, decode rows do not
    assert flash.op_counts(StepShape(prefill=((8, 0), (8, 0))))[0] == 2 * flash.cfg.num_layers
    assert flash.op_counts(StepShape(decode=(3, 4)))[0] == 0


def _shapes(rng: random.Random, n: int, drafts: bool = False) -> list[StepShape]:
    """Random steps; with ``drafts`` some decode sequences verify 1-3 drafts and an MTP pass follows."""
    out = []
    for _ in range(n):
        pre = tuple((rng.choice((2, 16, 64, 256, 1024, 2048)), rng.choice((0, 0, 512, 4096)))
                    for _ in range(rng.choice((0, 0, 1, 2))))
        dec = tuple(rng.randrange(0, 16000) for _ in range(rng.choice((0, 1, 4, 16)) if pre else rng.choice((1, 4, 16))))
        if not drafts:
            out.append(StepShape(prefill=pre, decode=dec))
            continue
        ver = tuple((rng.randint(1, 3), rng.randrange(0, 16000)) for _ in range(rng.choice((0, 1, 4))))
        calls = rng.choice((0, 1, 3))
        rows = calls and sum(n for n, _ in pre) + len(dec) + sum(1 + d for d, _ in ver) + 2 * (calls - 1)
        out.append(StepShape(prefill=pre, decode=dec, verify=ver, draft_calls=calls, draft_rows=rows,
                             draft_logit_rows=calls and min(rows, 4 * calls)))
    return out


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard", "smollm2-135m"])
def test_fit_recovers_the_coefficients_that_made_the_steps(name):
    work = StepWork(_cfg(name))
    rng = random.Random(7)
    drafts = bool(work.cfg.num_mtp_layers)      # the GLM presets draft with their MTP layer too
    truth = {"t_step": 2e-3, "t_seq": 1e-4, "t_dispatch_seq_layer": 3e-5, "t_dispatch_expert": 2e-5,
             "t_draft_call": 7e-4 if drafts else 0.0, "c_weights": 4.0, "c_experts": 6.0, "c_attention": 9.0,
             "c_attention_decode": 5.0, "c_recurrence": 12.0, "c_head": 3.0, "c_draft": 2.5 if drafts else 0.0,
             "c_prefill_rows": 150.0}
    made = StepCostModel(work, 2e11, 5e10, truth)
    shapes = _shapes(rng, 300, drafts)
    seconds = [made.seconds(s) for s in shapes]
    model, result = fit(work, shapes, seconds, 2e11, 5e10)
    assert result.median_rel_error < 1e-6 and result.p90_rel_error < 1e-6 and result.n_steps == 300
    for s in _shapes(random.Random(8), 50, drafts):     # steps the fit never saw
        assert model.seconds(s) == pytest.approx(made.seconds(s), rel=1e-5)
    assert sum(model.breakdown(shapes[0]).values()) == pytest.approx(model.seconds(shapes[0]))


def test_a_step_with_a_prefill_chunk_pays_m0_more_rows_of_the_weights_matmuls_and_a_decode_step_none():
    work = StepWork(_cfg("smollm2-135m"), weight_dtype="fp32")
    base = {**{t: 0.0 for t in TERMS}, "c_weights": 2.0}
    plain, m0 = StepCostModel(work, 2e11, 5e10, base), StepCostModel(work, 2e11, 5e10, {**base, "c_prefill_rows": 60.0})
    row = work.groups(StepShape(prefill=((1, 0),)))["weights"].flops     # one row's weight FLOPs
    for shape in (StepShape(prefill=((100, 0),)), StepShape(prefill=((30, 500), (70, 0)), decode=(9, 40))):
        assert m0.seconds(shape) - plain.seconds(shape) == pytest.approx(60.0 * row / 2e11)    # once per step
        assert m0.breakdown(shape)["c_prefill_rows"] == pytest.approx(60.0 * row / 2e11)
    assert m0.seconds(StepShape(decode=(9, 40))) == plain.seconds(StepShape(decode=(9, 40)))
    assert prefill_m0(m0.coefficients) == pytest.approx(30.0) and prefill_m0(plain.coefficients) == 0.0
    assert prefill_m0({t: 0.0 for t in TERMS}) is None
    # compute-bound steps: a chunk of M rows then costs (M + M0) rows at the large-M rate
    big = StepShape(prefill=((4096, 0),))
    assert m0.seconds(big) == pytest.approx(2.0 * (4096 + 30) * row / 2e11, rel=1e-9)


def test_fit_gives_an_unused_term_zero_and_never_a_negative_coefficient():
    work = StepWork(_cfg("smollm2-135m"))      # dense: no experts, no recurrence
    shapes = _shapes(random.Random(1), 80)
    rng = random.Random(2)
    seconds = [(0.01 + 1e-12 * work.groups(s)["weights"].flops) * rng.uniform(0.9, 1.1) for s in shapes]
    model, result = fit(work, shapes, seconds, 1e11, 1e10)
    assert model.coefficients["c_experts"] == model.coefficients["c_recurrence"] == 0.0
    assert model.coefficients["t_dispatch_expert"] == 0.0
    assert all(v >= 0 for v in model.coefficients.values())
    assert 0 < result.median_rel_error <= result.p90_rel_error < 0.2


def test_bad_inputs_are_refused_naming_what_is_wrong():
    work = StepWork(_cfg("tiny-flash"))
    with pytest.raises(ValueError, match="at least one sequence"):
        StepShape()
    with pytest.raises(ValueError, match="new tokens >= 1"):
        StepShape(prefill=((0, 5),))
    with pytest.raises(ValueError, match="weight dtype"):
        StepWork(_cfg("tiny-flash"), weight_dtype="fp4")
    with pytest.raises(ValueError, match="missing c_head"):
        StepCostModel(work, 1e11, 1e10, {t: 1.0 for t in TERMS if t != "c_head"})
    with pytest.raises(ValueError, match="t_seq"):
        StepCostModel(work, 1e11, 1e10, {**{t: 1.0 for t in TERMS}, "t_seq": -1.0})
    with pytest.raises(ValueError, match="at least"):
        fit(work, [StepShape(decode=(1,))], [0.1], 1e11, 1e10)
    with pytest.raises(ValueError, match="positive"):
        fit(work, [StepShape(decode=(1,))] * 20, [0.0] * 20, 1e11, 1e10)
    with pytest.raises(ValueError, match="seq_new_tokens"):
        StepShape.from_record({"step": 3, "num_tokens": 1})
    with pytest.raises(ValueError, match="equally long"):
        StepShape.from_record({"step": 3, "seq_new_tokens": [1, 2], "seq_cached_tokens": [0]})


def test_a_step_record_gives_its_shape():
    s = StepShape.from_record({"seq_new_tokens": [1, 300, 1, 2], "seq_cached_tokens": [40, 0, 7, 512]})
    assert s.prefill == ((300, 0), (2, 512)) and s.decode == (40, 7)
    assert s.num_seqs == 4 and s.num_tokens == 304 and s.kind == "mixed"
    assert StepShape(decode=(3,)).kind == "decode" and StepShape(prefill=((5, 0),)).kind == "prefill"
    assert set(GROUPS) == set(StepWork(_cfg("tiny-standard")).groups(s))


def test_engine_step_records_carry_the_step_composition():
    from engine_models import tiny_llama
    from flashlane.engine.llm import LLM
    from flashlane.engine.sampling_params import SamplingParams

    llm = LLM(tiny_llama(), max_num_batched_tokens=64, num_threads=1)
    prompt = list(range(3, 3 + 100))
    llm.generate([prompt, prompt[:40]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))   # a prefix hit
    recs = [r.to_json() for r in llm.engine.step_stats]
    assert recs and all(len(r["seq_new_tokens"]) == len(r["seq_cached_tokens"]) == r["num_seqs"] for r in recs)
    for r in recs:
        shape = StepShape.from_record(r)
        assert shape.num_tokens == r["num_tokens"]
        assert sum(n for n, _ in shape.prefill) == r["prefill_tokens"] and len(shape.decode) == r["decode_seqs"]
    first = recs[0]
    assert first["seq_new_tokens"][0] == 64 and first["seq_cached_tokens"] == [0] * first["num_seqs"]
    # the 100-token prompt's second chunk starts after the 64 computed by the first
    assert any(n == 36 and c == 64 for r in recs for n, c in zip(r["seq_new_tokens"], r["seq_cached_tokens"]))
    # the repeated prompt's prefill starts from its cached prefix, not from 0
    last_prefill = [r for r in recs if r["prefill_tokens"]][-1]
    assert last_prefill["seq_cached_tokens"][0] > 0


# ---- the calibration file and `flashlane calibrate` ------------------------------------------------
def test_calibrate_with_the_mtp_drafter_fits_its_verify_steps_and_passes(tmp_path, capsys):
    import json

    from flashlane.analyze.calibration import load_calibration
    from flashlane.cli.main import main

    out = tmp_path / "cal.json"
    spec = {"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_length": 2.0}
    rc = main(["calibrate", "tiny-standard", "--chunks", "64", "--batches", "1,3", "--contexts", "40,100",
               "--decode-tokens", "6", "--dtype", "float32", "--num-threads", "1", "--no-front-end",
               "--speculative-config", json.dumps(spec), "--out", str(out)])
    assert rc == 0
    capsys.readouterr()
    raw = json.loads(out.read_text())
    # the mode records the drafter and draft count (acceptance is the workload's), the fit the draft terms
    assert raw["mode"]["speculative"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert set(raw["coefficients"]) == set(TERMS)
    cal, _ = load_calibration(out)
    model = cal.cost_model(_cfg("tiny-standard"))
    plain = model.seconds(StepShape(decode=(50,)))
    assert model.seconds(StepShape(verify=((2, 50),), draft_calls=2, draft_rows=4, draft_logit_rows=2)) > plain
    # a calibration without the drafter reads with its draft terms at zero; another drafter is refused
    no_draft = {**raw, "mode": {**raw["mode"], "speculative": None},
                "coefficients": {k: v for k, v in raw["coefficients"].items() if k not in ("t_draft_call", "c_draft")}}
    (tmp_path / "old.json").write_text(json.dumps(no_draft))
    old, _ = load_calibration(tmp_path / "old.json")
    assert old.coefficients["t_draft_call"] == old.coefficients["c_draft"] == 0.0
    with pytest.raises(ValueError, match="engine mode speculative"):
        load_calibration(out, mode={"speculative": {"method": "mtp", "num_speculative_tokens": 3}})
    (tmp_path / "bad.json").write_text(json.dumps({**no_draft, "mode": raw["mode"]}))
    with pytest.raises(ValueError, match="t_draft_call"):      # measured with drafts, yet no draft terms
        load_calibration(tmp_path / "bad.json")
    # a file fitted before the prefill-rows term existed reads as that fit: the term at zero
    older = {**raw, "coefficients": {k: v for k, v in raw["coefficients"].items() if k != "c_prefill_rows"}}
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert load_calibration(tmp_path / "older.json")[0].coefficients["c_prefill_rows"] == 0.0



def test_calibrate_fits_the_engine_and_writes_a_calibration_that_checks_machine_and_mode(tmp_path, capsys):
    import json

    from flashlane.analyze.calibration import load_calibration
    from flashlane.cli.main import main
    from flashlane.machine import machine_info

    out = tmp_path / "cal.json"
    rc = main(["calibrate", "tiny-flash", "--chunks", "64", "--batches", "1,3", "--contexts", "40,100",
               "--batch-tokens", "150", "--decode-tokens", "3", "--dtype", "float32", "--num-threads", "1",
               "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "calibrated tiny-flash" in printed and "held out (2-fold)" in printed and "median |err|" in printed
    assert "  prefill chunks: the " in printed
    raw = json.loads(out.read_text())
    assert raw["schema"] == 1 and raw["mode"]["dtype"] == "float32" and raw["mode"]["compile"] is False
    assert raw["grid"]["steps"] >= len(TERMS) and raw["machine"]["cpu_model"]
    assert raw["grid"]["batch_tokens"] == 150
    assert set(raw["fit"]["by_kind"]) >= {"all", "prefill", "decode"}
    # the front end was measured one request at a time, then 3 at once (the largest batch)
    assert raw["front_end"]["served_decode_scale"] > 0 and raw["front_end"]["served_contention_seqs"] >= 2
    assert "waves of 3 at once" in raw["front_end"]["source"]
    # its requests as long as the grid's (--decode-tokens), after the grid's warm-up
    assert "3 tokens each, after a warm-up of 64 tokens and 3 at once" in raw["front_end"]["source"]
    here = machine_info()
    mode = dict(raw["mode"])
    cal, warnings = load_calibration(out, machine=here, mode=mode)
    assert warnings == [] and cal.model == "tiny-flash"
    # the fitted model prices a step of the config it was fitted on
    from flashlane.analyze.models import resolve_model
    assert cal.cost_model(resolve_model("tiny-flash").cfg).seconds(StepShape(decode=(50,))) > 0

    with pytest.raises(ValueError, match="engine mode compile"):
        load_calibration(out, machine=here, mode={**mode, "compile": True})
    with pytest.raises(ValueError, match="machine cpu_model"):
        load_calibration(out, machine={**here, "cpu_model": "Some Other CPU"}, mode=mode)
    other = "AVX512" if here["cpu_capability"] != "AVX512" else "AVX2"
    _, warned = load_calibration(out, machine={**here, "cpu_capability": other}, mode=mode, strict=False)
    assert warned and "cpu_capability" in warned[0]
    # step costs measured by other engine code (kernels, models, engine) describe another engine
    assert raw["machine"]["engine_code"] == here["engine_code"]
    with pytest.raises(ValueError, match="machine engine_code"):
        load_calibration(out, machine={**here, "engine_code": "0123456789ab"}, mode=mode)

    # --front-end-only: the front end measured anew on the calibration's mode, the fitted step costs kept
    again = tmp_path / "again.json"
    assert main(["calibrate", "tiny-flash", "--front-end-only", str(out), "--out", str(again)]) == 0
    capsys.readouterr()
    refreshed = json.loads(again.read_text())
    assert refreshed["coefficients"] == raw["coefficients"] and refreshed["mode"] == raw["mode"]
    assert refreshed["front_end"] != raw["front_end"] and "waves of 3 at once" in refreshed["front_end"]["source"]
    assert "3 tokens each" in refreshed["front_end"]["source"]      # the grid's, from the calibration
    assert "--front-end-only" in refreshed["notes"][-1]
    for argv, named in [(["tiny-standard", "--front-end-only", str(out)], "tiny-flash"),
                        (["tiny-flash", "--front-end-only", str(tmp_path / "none.json")], "cannot read"),
                        (["tiny-flash", "--front-end-only", str(out), "--no-front-end"], "--no-front-end")]:
        assert main(["calibrate", *argv, "--out", str(tmp_path / "x.json")]) == 2
        assert named in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_calibration_from_a_newer_schema_or_missing_fields_is_refused(tmp_path):
    import json

    from flashlane.analyze.calibration import load_calibration

    p = tmp_path / "c.json"
    p.write_text(json.dumps({"schema": 2, "model": "x"}))
    with pytest.raises(ValueError, match="schema 2 is newer"):
        load_calibration(p)
    p.write_text(json.dumps({"schema": 1, "model": "x"}))
    with pytest.raises(ValueError, match="missing field"):
        load_calibration(p)
    p.write_text("not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_calibration(p)


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard", "smollm2-135m"])
def test_the_fitted_groups_split_attention_into_prefill_and_decode_and_sum_to_the_groups(name):
    work = StepWork(_cfg(name))
    shape = StepShape(prefill=((300, 700), (64, 0)), decode=(5, 900, 3000))
    whole, split = work.groups(shape), work.fitted_groups(shape)
    assert split["attention"].flops + split["attention_decode"].flops == pytest.approx(whole["attention"].flops)
    assert split["attention"].bytes + split["attention_decode"].bytes == pytest.approx(whole["attention"].bytes)
    decode_only = work.groups(StepShape(decode=shape.decode))["attention"]
    assert split["attention_decode"].flops == pytest.approx(decode_only.flops) and decode_only.flops > 0
    assert work.fitted_groups(StepShape(prefill=((64, 0),)))["attention_decode"].bytes == 0.0


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard", "glm-5.3-flash", "glm-5.3"])
def test_verified_drafts_are_a_chunk_eagerly_and_decode_rows_in_graphs_with_logits_on_every_row(name):
    cfg = _cfg(name)
    eager, graphs = StepWork(cfg), StepWork(cfg, graphs=True)
    shape = StepShape(decode=(50,), verify=((3, 900),))
    as_chunk = eager.groups(StepShape(prefill=((4, 900),), decode=(50,)))
    as_rows = graphs.groups(StepShape(decode=(50, 900, 901, 902, 903)))
    head = eager.groups(StepShape(decode=(0,)))["head"].flops      # one row's logits
    for work, plain in ((eager, as_chunk), (graphs, as_rows)):
        got = work.groups(shape)
        for g in ("weights", "experts", "attention", "recurrence"):
            assert got[g].flops == pytest.approx(plain[g].flops, rel=1e-12), g
            if g != "recurrence":     # a sequence's state is read and written once, however many rows
                assert got[g].bytes == pytest.approx(plain[g].bytes, rel=1e-12), g
        assert got["recurrence"].bytes == pytest.approx(as_chunk["recurrence"].bytes)
        assert got["head"].flops == pytest.approx(5 * head)             # the decode row and all 4 verified rows
    assert eager.op_counts(shape)[0] == cfg.num_layers and graphs.op_counts(shape)[0] == 0
    assert shape.num_tokens == 5 and shape.num_seqs == 2 and shape.kind == "decode"


@pytest.mark.parametrize("name", ["tiny-flash", "glm-5.3"])
def test_the_draft_group_is_the_mtp_layer_over_its_rows_and_the_head_over_the_drafted_ones(name):
    from flashlane.analyze.params import mtp_layer_params

    cfg = _cfg(name)
    work = StepWork(cfg)
    assert work.groups(StepShape(decode=(5,)))["draft"] == type(work.draft(StepShape(decode=(5,))))(0.0, 0.0)
    one = work.draft(StepShape(decode=(5,), draft_calls=1, draft_rows=1, draft_logit_rows=1))
    head = work.groups(StepShape(decode=(0,)))["head"]
    assert one.flops == pytest.approx(2 * mtp_layer_params(cfg)[1] + head.flops)
    three = work.draft(StepShape(decode=(5,), draft_calls=3, draft_rows=12, draft_logit_rows=6))
    assert three.flops == pytest.approx(12 * 2 * mtp_layer_params(cfg)[1] + 6 * head.flops)
    # weights (and the head) are read once per call; more rows per call touch more experts
    assert three.bytes > 3 * one.bytes - 1e-6
    assert one.bytes > head.bytes


def test_a_record_with_drafts_gives_its_verify_rows_and_mtp_pass():
    rec = {"step": 3, "seq_new_tokens": [4, 1, 30, 3], "seq_cached_tokens": [100, 7, 0, 60],
           "seq_draft_tokens": [3, 0, 0, 2], "draft_calls": 3, "draft_rows": 40, "draft_logit_rows": 6}
    s = StepShape.from_record(rec)
    assert s.verify == ((3, 100), (2, 60)) and s.decode == (7,) and s.prefill == ((30, 0),)
    assert (s.draft_calls, s.draft_rows, s.draft_logit_rows) == (3, 40, 6)
    assert s.num_tokens == 38 and s.kind == "mixed"
    with pytest.raises(ValueError, match="seq_draft_tokens"):
        StepShape.from_record({**rec, "seq_draft_tokens": [1]})
    old = StepShape.from_record({k: v for k, v in rec.items() if not k.startswith("draft") and k != "seq_draft_tokens"})
    assert old.verify == () and old.prefill == ((4, 100), (30, 0), (3, 60)) and old.draft_calls == 0


def test_the_engine_code_fingerprint_follows_the_sources_and_nothing_else(tmp_path):
    from flashlane.machine import code_fingerprint, engine_code

    native = tmp_path / "kernels" / "native"
    native.mkdir(parents=True)
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "core.py").write_text("step = 1\n")
    (native / "k.cpp").write_text("int k() { return 1; }\n")
    first = code_fingerprint(tmp_path)
    assert len(first) == 12 and int(first, 16) >= 0
    (native / "notes.txt").write_text("not code")                    # not a source
    (tmp_path / "engine" / "__pycache__").mkdir()
    (tmp_path / "engine" / "__pycache__" / "core.py").write_text("cached")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "main.py").write_text("front end")          # outside the engine
    assert code_fingerprint(tmp_path) == first
    (native / "k.cpp").write_text("int k() { return 2; }\n")        # a kernel changed
    assert code_fingerprint(tmp_path) != first
    assert len(engine_code()) == 12


def test_the_front_end_measurement_refuses_requests_without_a_decode_step():
    from flashlane.simulate.measure_front_end import measure_front_end

    with pytest.raises(ValueError, match="output_tokens must be >= 2"):
        measure_front_end("tiny-flash", [], synth=None, output_tokens=1)
