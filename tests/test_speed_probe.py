"""The machine-speed probe a calibration and a compare run take, and the drift a simulation is
scaled by (simulate.speed_probe)."""

from __future__ import annotations

import pytest
import torch

from flashlane.analyze.calibration import Calibration, load_calibration
from flashlane.analyze.models import resolve_model
from flashlane.analyze.step_cost import HOST_TERMS, TERMS, StepCostModel, StepShape, StepWork
from flashlane.simulate import setup as sim_setup
from flashlane.simulate.front_end import FrontEnd
from flashlane.simulate.speed_probe import PROBE_VERSION, Drift, SpeedProbe, drift, measure_speed

MODEL = "tiny-flash"
COEFFICIENTS = {**{t: 0.0 for t in TERMS}, "t_step": 1e-3, "t_seq": 2e-4, "t_dispatch_seq_layer": 1e-5,
                "c_weights": 1.5, "c_attention": 1.2, "c_recurrence": 1.1, "c_head": 1.0}
FRONT_END = {"request_s": 0.004, "per_prompt_token_s": 2e-6, "token_s": 0.001, "step_gap_s": 0.0002,
             "served_prefill_scale": 1.1, "served_decode_scale": 1.2, "source": "measured"}


def probe(compute=0.01, memory=0.03, host=0.005, dtype="float32", threads=1, version=PROBE_VERSION) -> SpeedProbe:
    return SpeedProbe(compute, memory, host, dtype, threads, 0.0, version)


def calibration(probes: list[SpeedProbe] | None) -> Calibration:
    from flashlane.machine import machine_info

    mode = {"dtype": "float32", "kv_cache_dtype": "float32", "quantization": None, "compile": False,
            "kernel_backend": "cpu", "num_threads": 1}
    return Calibration(MODEL, machine_info(), mode, 2e11, 2e10, "fp32", "bf16", dict(COEFFICIENTS),
                       {"median_rel_error": 0.05}, {}, 1.0, front_end=dict(FRONT_END),
                       speed_probes=None if probes is None else [p.to_dict() for p in probes])


def test_the_probe_times_its_three_pieces_in_the_asked_threads_and_restores_them():
    before = torch.get_num_threads()
    p = measure_speed("float32", 1, repeats=2)
    assert torch.get_num_threads() == before
    assert p.compute_s > 0 and p.memory_s > 0 and p.host_s > 0
    assert (p.dtype, p.threads) == ("float32", 1)
    assert SpeedProbe.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("kwargs, field", [({"dtype": "float99"}, "dtype"), ({"threads": 0}, "threads")])
def test_a_bad_probe_argument_is_an_error_naming_it(kwargs, field):
    with pytest.raises(ValueError, match=field):
        measure_speed(**{"dtype": "float32", "threads": 1, **kwargs})


def test_a_stored_probe_with_a_missing_or_bad_time_is_refused():
    with pytest.raises(ValueError, match="memory_s"):
        SpeedProbe.from_dict({k: v for k, v in probe().to_dict().items() if k != "memory_s"})
    with pytest.raises(ValueError, match="> 0"):
        SpeedProbe.from_dict({**probe().to_dict(), "host_s": 0.0})


def test_drift_is_the_ratio_of_the_medians_now_over_then():
    then = [probe(0.010, 0.030, 0.004), probe(0.012, 0.034, 0.006)]         # medians 0.011, 0.032, 0.005
    now = [probe(0.0132, 0.032, 0.006), probe(0.0154, 0.040, 0.006),
           probe(0.0143, 0.036, 0.007)]                                       # medians 0.0143, 0.036, 0.006
    d, why = drift(now, then)
    assert why is None
    assert (d.compute, d.memory, d.host) == pytest.approx((1.3, 1.125, 1.2))
    assert (d.probes_now, d.probes_then) == (3, 2)


@pytest.mark.parametrize("now, then, reason", [
    ([], [probe()], "no speed probe beside the run"),
    ([probe()], [], "calibration has no speed probe"),
    ([probe(dtype="bfloat16")], [probe()], "dtype"),
    ([probe(threads=2)], [probe()], "threads"),
    ([probe(version=PROBE_VERSION - 1)], [probe()], "version"),
])
def test_no_drift_is_given_without_comparable_probes_and_says_why(now, then, reason):
    d, why = drift(now, then)
    assert d is None and reason in why


def test_drift_scales_flop_bound_work_by_compute_bytes_by_memory_and_host_terms_by_host():
    cfg = resolve_model(MODEL).cfg
    base = StepCostModel(StepWork(cfg, "fp32", "bf16"), 2e11, 2e10, COEFFICIENTS)
    d = Drift(compute=1.3, memory=1.1, host=1.2, probes_now=1, probes_then=1)
    scaled = d.scale_cost(base)
    assert scaled.peak_flops == pytest.approx(2e11 / 1.3) and scaled.mem_bw == pytest.approx(2e10 / 1.1)
    shape = StepShape(prefill=((512, 0),), decode=(40, 90))
    before, after = base.breakdown(shape), scaled.breakdown(shape)
    for t in HOST_TERMS:
        assert after[t] == pytest.approx(before[t] * 1.2)
    # each op group is max(flops / peak, bytes / bw): it grows by between the two ratios (by one
    # where it stays on that bound; in between where the slower compute moves it to the other)
    for t in ("c_weights", "c_attention", "c_recurrence", "c_head"):
        assert 1.1 - 1e-9 <= after[t] / before[t] <= 1.3 + 1e-9
    assert after["c_weights"] == pytest.approx(1.3 * before["c_weights"])      # 514 rows: compute-bound
    assert before["t_step"] > 0 and sum(after.values()) > sum(before.values())
    same = Drift(1.0, 1.0, 1.0, 1, 1).scale_cost(base)
    assert same.seconds(shape) == pytest.approx(base.seconds(shape), rel=1e-12)


def test_drift_scales_the_front_ends_times_by_host_and_keeps_its_served_step_scales():
    front = FrontEnd.from_dict(FRONT_END)
    got = Drift(1.3, 1.1, 1.5, 1, 1).scale_front_end(front)
    for k in ("request_s", "per_prompt_token_s", "token_s", "step_gap_s"):
        assert getattr(got, k) == pytest.approx(1.5 * getattr(front, k))
    assert (got.served_prefill_scale, got.served_decode_scale) == (1.1, 1.2)


def test_a_simulation_at_the_runs_speed_prices_steps_and_front_end_with_the_drift():
    d = Drift(1.25, 1.1, 1.4, 2, 2)
    plain, _ = sim_setup.calibrated(MODEL, calibration([probe()]), {})
    drifted, _ = sim_setup.calibrated(MODEL, calibration([probe()]), {}, drift=d)
    cost = calibration(None).cost_model(resolve_model(MODEL).cfg)
    front = FrontEnd.from_dict(FRONT_END)
    shape = StepShape(prefill=((300, 0),))
    assert drifted.cost(shape) == pytest.approx(front.served(d.scale_cost(cost).seconds)(shape), rel=1e-12)
    assert drifted.cost(shape) > plain.cost(shape)
    assert drifted.front_end.request_s == pytest.approx(1.4 * plain.front_end.request_s)
    assert drifted.assumptions["calibration"]["drift"] == d.to_dict()
    assert plain.assumptions["calibration"]["drift"] is None


def test_a_calibrations_probes_survive_a_round_trip_and_an_older_file_reads_none(tmp_path):
    cal = calibration([probe(), probe(0.02)])
    cal.save(tmp_path / "new.json")
    back, _ = load_calibration(tmp_path / "new.json")
    assert [SpeedProbe.from_dict(p) for p in back.speed_probes] == [probe(), probe(0.02)]
    calibration(None).save(tmp_path / "old.json")
    old, _ = load_calibration(tmp_path / "old.json")
    assert old.speed_probes is None


def test_compares_simulator_probes_between_rounds_and_a_side_takes_those_around_its_rounds(tmp_path, monkeypatch):
    """The simulator takes a probe before every round of a stack's load point and after the last,
    in the servers' dtype and threads; a side's drift compares the probes on either side of its
    rounds with its calibration's; a calibration without probes is simulated at its own speed,
    saying why."""
    from types import SimpleNamespace

    import flashlane.cli.compare_simulation as cs

    taken = []

    def fake_probe(dtype, threads):
        taken.append((dtype, threads))
        return probe(compute=0.010 + 0.001 * len(taken))

    monkeypatch.setattr(cs, "measure_speed", fake_probe)
    sim = cs.LocalSimulator(["--dtype", "float32", "--num-threads", "1"], tmp_path, log=lambda m: None,
                            cache_dir=tmp_path / "cal")
    for stack in ("naive", "flashlane"):
        for position in range(5):                   # A B B A, then after the last
            sim.between_rounds(stack, "c1", position)
    assert taken == [("float32", 1)] * 10 and len(sim.probes) == 10
    a_rounds = [SimpleNamespace(position=0), SimpleNamespace(position=3)]
    b_rounds = [SimpleNamespace(position=1), SimpleNamespace(position=2)]
    mine = sim.round_probes("flashlane", "c1", a_rounds)
    assert [p.compute_s for p in mine] == pytest.approx([0.016, 0.017, 0.019, 0.020])   # positions 0, 1, 3, 4
    assert [p.compute_s for p in sim.round_probes("naive", "c1", b_rounds)] == pytest.approx([0.012, 0.013, 0.014])
    d, why = sim.drift(calibration([probe(compute=0.010)]), mine)
    assert why is None and d.compute == pytest.approx(1.8)
    d, why = sim.drift(calibration(None), mine)
    assert d is None and "no speed probe" in why


def test_a_simulated_server_retimed_keeps_its_engine_and_refuses_other_engine_arguments():
    from flashlane.simulate.run import SimulatedServer

    plain, _ = sim_setup.calibrated(MODEL, calibration([probe()]), {})
    server = SimulatedServer(plain)
    engine = server.engine
    drifted, _ = sim_setup.calibrated(MODEL, calibration([probe()]), {}, drift=Drift(2.0, 2.0, 2.0, 1, 1))
    server.retime(drifted)
    assert server.engine is engine and server.engine.cost is drifted.cost and server.setup is drifted
    other, _ = sim_setup.calibrated(MODEL, calibration([probe()]), {"enable_prefix_caching": False})
    with pytest.raises(ValueError, match="engine arguments"):
        server.retime(other)


def test_a_probe_waits_for_the_machine_to_go_quiet_and_records_it(monkeypatch):
    """Right after a round the servers still work for a moment: the probe waits until the machine's
    CPU use (in % of one core) falls below the bar, or gives up after the wait's limit."""
    import psutil

    from flashlane.simulate import speed_probe

    readings = iter([60.0, 30.0, 2.0])          # % of all cores, as psutil gives it
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval: next(readings))
    monkeypatch.setattr(psutil, "cpu_count", lambda: 2)
    waited, busy = speed_probe.wait_for_quiet(max_s=60.0, busy_pct=10.0)
    assert busy == 4.0 and waited >= 0.0
    with pytest.raises(StopIteration):
        next(readings)                              # it read until quiet, and no further
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval: 90.0)
    waited, busy = speed_probe.wait_for_quiet(max_s=0.0, busy_pct=10.0)
    assert busy == 180.0                            # still busy: it gave up at the limit
    monkeypatch.setattr(speed_probe, "wait_for_quiet", lambda max_s: (1.5, 3.0))
    p = measure_speed("float32", 1, repeats=1)
    assert (p.quiet_wait_s, p.busy_pct) == (1.5, 3.0)
    assert SpeedProbe.from_dict(p.to_dict()) == p
    assert measure_speed("float32", 1, repeats=1, quiet_s=0).busy_pct is None
