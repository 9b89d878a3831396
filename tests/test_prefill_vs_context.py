"""The pure helpers of benchmarks/prefill_vs_context.py (run order, roofline arithmetic, per-token
growth, goal evaluation) on hand-made numbers; no model runs. How fast prefill is, is the
benchmark's to say, not a test's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "prefill_vs_context.py"


@pytest.fixture(scope="module")
def pvc():
    spec = importlib.util.spec_from_file_location("prefill_vs_context", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def side(engine_tok_s: float, wall_tok_s: float | None = None) -> dict:
    return {"engine_tok_s": engine_tok_s, "wall_tok_s": wall_tok_s or engine_tok_s}


def test_abba_flips_the_pair_order_on_every_other_key(pvc):
    order = pvc.abba_order(["k0", "k1", "k2"])
    assert order == [("k0", "baseline"), ("k0", "current"), ("k1", "current"), ("k1", "baseline"),
                     ("k2", "baseline"), ("k2", "current")]
    assert pvc.abba_order([]) == []


def test_roofline_is_context_times_peak_over_flops(pvc):
    # 1e12 FLOP for 1000 tokens at 1e11 FLOP/s: 10 s, so 100 tok/s at the roof; 75 tok/s is 75 %
    r = pvc.roofline(1e12, 1e11, 1000, 75.0)
    assert r["tok_s"] == pytest.approx(100.0)
    assert r["fraction"] == pytest.approx(0.75)
    assert pvc.roofline(1e12, 1e11, 1000, None)["fraction"] is None


def test_make_row_ratios_use_engine_time_for_baseline_and_wall_for_transformers(pvc):
    sides = {"flashlane": side(400.0, 300.0), "baseline": side(100.0, 90.0), "transformers": {"tok_s": 60.0}}
    row = pvc.make_row("tiny-flash", 8192, "float32", sides, flops=8192 * 1e6, peak=1e9, local_peak=5e8)
    assert row["speedup_vs_baseline"] == pytest.approx(4.0)
    assert row["speedup_vs_transformers"] == pytest.approx(5.0)
    # 1e6 FLOP per token at 1e9 FLOP/s: 1000 tok/s at the roof
    assert row["roofline"]["tok_s"] == pytest.approx(1000.0)
    assert row["roofline"]["fraction"] == pytest.approx(0.4)
    assert row["roofline"]["baseline_fraction"] == pytest.approx(0.1)
    assert row["roofline"]["local_profile_fraction"] == pytest.approx(0.8)


def test_a_skipped_side_gives_no_ratio_and_the_table_still_renders(pvc):
    sides = {"flashlane": side(400.0), "baseline": None, "transformers": {"skipped": "ran past --max-side-s 5"}}
    row = pvc.make_row("tiny-standard", 16384, "float32", sides, flops=1e10, peak=1e9, local_peak=None)
    assert row["speedup_vs_baseline"] is None and row["speedup_vs_transformers"] is None
    assert "local_profile_fraction" not in row["roofline"]
    text = pvc.table([row])
    assert "tiny-standard" in text and "16384" in text


def test_per_token_growth_is_the_ratio_of_rates(pvc):
    rows = [{"model": "tiny-standard", "context": 4096, "flashlane": side(1200.0)},
            {"model": "tiny-standard", "context": 16384, "flashlane": side(1000.0)},
            {"model": "tiny-flash", "context": 4096, "flashlane": side(900.0)}]
    # time per token grows as 1/rate: (1/1000) / (1/1200)
    assert pvc.per_token_growth(rows, "tiny-standard") == pytest.approx(1.2)
    assert pvc.per_token_growth(rows, "tiny-flash") is None      # no 16K row
    rows[1]["flashlane"] = {"skipped": "boom"}
    assert pvc.per_token_growth(rows, "tiny-standard") is None


def _rows(pvc, cur: dict, base: dict | None, hf: dict, fraction: float = 0.8) -> list[dict]:
    """Rows for every goal's model and context: ``cur``/``base``/``hf`` map (model, ctx) -> tok/s;
    smollm2's roofline is set up so its fraction is ``fraction``."""
    rows = []
    for (m, c), tps in cur.items():
        sides = {"flashlane": side(tps), "baseline": side(base[(m, c)]) if base else None,
                 "transformers": {"tok_s": hf[(m, c)]}}
        flops = fraction * c * 1e9 / tps     # so that tps / (c * peak / flops) == fraction at peak 1e9
        rows.append(pvc.make_row(m, c, "bfloat16", sides, flops=flops, peak=1e9, local_peak=None))
    return rows


def _goals(goals: list[dict]) -> dict:
    return {g["goal"]: g for g in goals}


KEYS = [("tiny-flash", 8192), ("tiny-standard", 4096), ("tiny-standard", 8192), ("tiny-standard", 16384),
        ("smollm2-135m", 1024), ("smollm2-135m", 8192)]


def test_goals_all_met(pvc):
    cur = {("tiny-flash", 8192): 500.0, ("tiny-standard", 4096): 650.0, ("tiny-standard", 8192): 600.0,
           ("tiny-standard", 16384): 500.0, ("smollm2-135m", 1024): 300.0, ("smollm2-135m", 8192): 200.0}
    base = {k: v / 5 for k, v in cur.items()}
    base[("smollm2-135m", 1024)] = 300.0            # equal to today's still counts as no slower
    hf = {k: v / 3.5 for k, v in cur.items()}
    goals = pvc.evaluate_goals(_rows(pvc, cur, base, hf))
    assert len(goals) == 7
    assert all(g["pass"] is True for g in goals), [g for g in goals if g["pass"] is not True]
    growth = _goals(goals)["tiny-standard prefill time per token 16384 / 4096 <= 1.5"]
    assert growth["value"] == pytest.approx(650.0 / 500.0)


def test_each_goal_fails_on_its_own_number(pvc):
    cur = {("tiny-flash", 8192): 500.0, ("tiny-standard", 4096): 1000.0, ("tiny-standard", 8192): 600.0,
           ("tiny-standard", 16384): 600.0, ("smollm2-135m", 1024): 300.0, ("smollm2-135m", 8192): 200.0}
    base = {k: v / 5 for k, v in cur.items()}
    base[("tiny-flash", 8192)] = 500.0 / 3.9        # 3.9x: short of 4x
    base[("smollm2-135m", 8192)] = 201.0            # slower than today at one context
    hf = {k: v / 3.5 for k, v in cur.items()}
    hf[("tiny-standard", 8192)] = 600.0 / 2.9       # 2.9x transformers: short of 3x
    g = _goals(pvc.evaluate_goals(_rows(pvc, cur, base, hf, fraction=0.7)))
    assert g["tiny-flash prefill at 8192 >= 4x today's"]["pass"] is False
    assert g["tiny-flash prefill at 8192 >= 3x transformers"]["pass"] is True
    assert g["tiny-standard prefill at 8192 >= 4x today's"]["pass"] is True
    assert g["tiny-standard prefill at 8192 >= 3x transformers"]["pass"] is False
    growth = g["tiny-standard prefill time per token 16384 / 4096 <= 1.5"]
    assert growth["pass"] is False and growth["value"] == pytest.approx(1000.0 / 600.0)
    slower = g["smollm2-135m prefill no slower than today (every context)"]
    assert slower["pass"] is False and slower["value"] == pytest.approx(200.0 / 201.0)
    peak = g["smollm2-135m prefill >= 75% of the bfloat16 matmul peak (every context)"]
    assert peak["pass"] is False and peak["value"] == pytest.approx(0.7)


def test_goals_without_a_baseline_or_a_model_are_not_measured_not_failed(pvc):
    cur = {k: 500.0 for k in KEYS if k[0] != "smollm2-135m"}
    hf = {k: 100.0 for k in cur}
    g = _goals(pvc.evaluate_goals(_rows(pvc, cur, None, hf)))
    today = g["tiny-flash prefill at 8192 >= 4x today's"]
    assert today["pass"] is None and "baseline" in today["why"]
    assert g["tiny-flash prefill at 8192 >= 3x transformers"]["pass"] is True
    dense = g["smollm2-135m prefill no slower than today (every context)"]
    assert dense["pass"] is None and dense["why"] == "not run"


def test_src_dir_prefers_the_trees_src_folder(pvc, tmp_path):
    assert pvc.src_dir(tmp_path) == tmp_path
    (tmp_path / "src" / "flashlane").mkdir(parents=True)
    assert pvc.src_dir(tmp_path) == tmp_path / "src"


def test_repeats_shrink_to_what_fits_in_max_side_s(pvc, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(pvc.time, "perf_counter", lambda: clock[0])

    def run():                       # every call (warm-up included) takes 10 s of the fake clock
        clock[0] += 10.0
        return {"wall_s": 10.0}

    def repeat(max_s):
        clock[0] = 0.0
        return pvc._repeat(run, 3, max_s, t_start=0.0)

    assert repeat(100.0)["repeats_done"] == 3
    assert repeat(35.0)["repeats_done"] == 2       # 10 s warm-up + 2 x 10 s fit in 35 s, a third not
    skipped = repeat(15.0)
    assert "runs" not in skipped and "--max-side-s 15" in skipped["skipped"]
