"""The GPU step-cost model: its work is StepWork's split over the layout, its terms are the ones
computed here by hand (groups' roofline, all-reduce, all-to-all, dispatch, host), bad layouts and
hardware names are refused naming the field, and every assumption carries a source."""

from __future__ import annotations

import random
import timeit
from dataclasses import replace

import pytest

from flashlane.analyze.cache import cache_bytes, index_entry_bytes, latent_row_bytes
from flashlane.analyze.flops import attended_positions, scored_keys
from flashlane.analyze.gpu_step_cost import (CommAssumptions, HardwareStepCost, HostAssumptions, ParallelLayout,
                                             parse_hardware_spec)
from flashlane.analyze.hardware import HARDWARE
from flashlane.analyze.memory import REPLICATED, TP_SPLIT, Layout, component_bytes
from flashlane.analyze.models import resolve_model
from flashlane.analyze.params import count_params
from flashlane.analyze.roofline import Roofline, Setup
from flashlane.analyze.step_cost import GROUPS, StepShape, StepWork

CONFIGS = ("tiny-flash", "tiny-standard", "smollm2-135m", "glm-5.3-flash", "glm-5.3")
H200 = HARDWARE["h200"]
NO_HOST = HostAssumptions(0.0, 0.0)
NO_DISPATCH = replace(H200, kernel_launch_s=0.0, graph_replay_s=0.0)
KNOWN = ("b200", "h100", "h200", "mi355x")


def _cfg(name):
    return resolve_model(name).cfg


_WORK: dict = {}


def _work(name, dtype="fp8", kv="bf16") -> StepWork:
    key = (name, dtype, kv)
    if key not in _WORK:
        _WORK[key] = StepWork(_cfg(name), dtype, kv)
    return _WORK[key]


def _model(name, devices=1, ep=1, graphs=True, hw=NO_DISPATCH, host=NO_HOST, dtype="fp8", **kw):
    return HardwareStepCost(_work(name, dtype), hw, ParallelLayout(devices, devices, ep), graphs, host, dtype, **kw)


def _roof(work, peak, mfu=0.6, mbu=0.8, bw=H200.mem_bw):
    return max(work.flops / (peak * mfu), work.bytes / (bw * mbu))


# ---- hardware specs and layouts ---------------------------------------------------------------

@pytest.mark.parametrize("spec, name, count", [("h200x8", "h200", 8), ("H200x8", "h200", 8), ("h100", "h100", 1),
                                               ("b200x4", "b200", 4), ("mi355x", "mi355x", 1),
                                               ("MI355Xx2", "mi355x", 2)])
def test_hardware_specs_name_a_profile_and_a_count(spec, name, count):
    assert parse_hardware_spec(spec) == (HARDWARE[name], count)


@pytest.mark.parametrize("spec", ["h300x8", "h200x0", "h200x", "h200xq", "x8", "local", "localx2", ""])
def test_bad_hardware_specs_name_the_option_and_the_known_names(spec):
    with pytest.raises(ValueError, match="--hardware") as exc:
        parse_hardware_spec(spec)
    assert all(n in str(exc.value) for n in KNOWN) and "local," not in str(exc.value)


@pytest.mark.parametrize("args, field", [((8, 4, 1), "tp"), ((8, 8, 3), "ep"), ((8, 8, 16), "ep"),
                                         ((0, 0, 1), "devices"), ((8, 8, 0), "ep"), ((2, 0, 1), "tp")])
def test_bad_layouts_are_refused_naming_the_field(args, field):
    with pytest.raises(ValueError, match=rf"ParallelLayout\.{field}"):
        ParallelLayout(*args)


def test_tp_below_devices_says_dp_attention_is_not_modelled():
    with pytest.raises(ValueError, match="data-parallel attention is not modelled"):
        ParallelLayout(8, 4, 2)


def test_bad_model_inputs_are_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="ep"):                       # 18 experts over 4 ep groups
        _model("tiny-flash", devices=4, ep=4)
    with pytest.raises(ValueError, match="weight_dtype"):            # a bf16 StepWork priced as fp8
        HardwareStepCost(_work("tiny-flash", "bf16"), H200, ParallelLayout(1, 1), True, weight_dtype="fp8")
    with pytest.raises(ValueError, match="weight_dtype"):
        HardwareStepCost(_work("tiny-flash", "bf16"), H200, ParallelLayout(1, 1), True, weight_dtype="int8")
    with pytest.raises(ValueError, match="mfu"):
        _model("tiny-flash", mfu=1.5)
    with pytest.raises(ValueError, match="interconnect_bw"):
        _model("tiny-flash", devices=2, hw=replace(H200, interconnect_bw=None))
    with pytest.raises(ValueError, match="step_s"):
        HostAssumptions(step_s=-1.0)
    with pytest.raises(ValueError, match="all_reduce_latency_s"):
        CommAssumptions(all_reduce_latency_s=float("nan"))


# ---- the work is StepWork's -------------------------------------------------------------------

def _random_shapes(rng, n):
    out = []
    for _ in range(n):
        pre = tuple((rng.choice((2, 17, 300, 2048, 8192)), rng.choice((0, 0, 511, 4096, 100_000)))
                    for _ in range(rng.choice((0, 1, 2))))
        n_dec = rng.choice((0, 1, 3, 64)) if pre else rng.choice((1, 5, 64))
        dec = tuple(rng.randrange(0, 200_000) for _ in range(n_dec))
        ver = tuple((rng.randint(1, 4), rng.randrange(0, 200_000)) for _ in range(rng.choice((0, 0, 1, 8))))
        calls = rng.choice((0, 1, 3)) if ver else 0
        out.append(StepShape(prefill=pre, decode=dec, verify=ver, draft_calls=calls, draft_rows=calls * 5,
                             draft_logit_rows=calls * 2))
    return out


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("kv", ["bf16", "fp8", "int8"])
def test_one_device_does_the_whole_stepwork(name, kv):
    work = _work(name, "bf16", kv)
    model = HardwareStepCost(work, H200, ParallelLayout(1, 1), True, weight_dtype="bf16")
    assert kv in model.kv_dtype
    for shape in _random_shapes(random.Random(3), 25):
        mine, want = model.device_work(shape), model.work.groups(shape)     # verify rows as in graphs
        for g in GROUPS:
            assert mine[g].flops == pytest.approx(want[g].flops, rel=1e-12, abs=1e-9), (g, shape)
            assert mine[g].bytes == pytest.approx(want[g].bytes, rel=1e-12, abs=1e-9), (g, shape)


def test_tp1_prefill_is_the_sum_of_the_groups_roofline():
    work = _work("glm-5.3-flash")
    model = _model("glm-5.3-flash")              # one H200, no host, launch or replay cost
    shape = StepShape(prefill=((8192, 20_000),), decode=(500, 70_000))
    peak = {"weights": H200.peak("fp8"), "experts": H200.peak("fp8"), "attention": H200.peak("bf16"),
            "recurrence": H200.peak("bf16"), "head": H200.peak("bf16"), "draft": H200.peak("fp8")}
    by_hand = sum(_roof(w, peak[g]) for g, w in work.groups(shape).items())
    assert model.seconds(shape) == pytest.approx(by_hand, rel=1e-12)
    b = model.breakdown(shape)
    assert b["all_reduce"] == b["all_to_all"] == b["dispatch"] == b["host_step"] == 0.0


# ---- tensor and expert parallelism -----------------------------------------------------------

def test_doubling_tp_halves_a_compute_bound_prefill_and_adds_the_all_reduce():
    shape = StepShape(prefill=((8192, 0),))
    one, two = _model("smollm2-135m", dtype="bf16"), _model("smollm2-135m", devices=2, dtype="bf16")
    cfg, bw = _cfg("smollm2-135m"), H200.interconnect_bw
    # every group halves: weights and attention are compute-bound, the head (one logit row) reads 1/tp
    w1, w2 = one.device_work(shape), two.device_work(shape)
    for g in ("weights", "attention", "head"):
        assert w2[g].flops == pytest.approx(w1[g].flops / 2, rel=1e-12)
    assert w1["weights"].flops / (H200.peak("bf16") * 0.6) > w1["weights"].bytes / (H200.mem_bw * 0.8)
    assert w2["attention"].flops / (H200.peak("bf16") * 0.6) > w2["attention"].bytes / (H200.mem_bw * 0.8)
    all_reduce = 2 * cfg.num_layers * (10e-6 + 2 * (2 - 1) / 2 * 8192 * cfg.hidden_size * 2 / bw)
    assert two.breakdown(shape)["all_reduce"] == pytest.approx(all_reduce, rel=1e-12)
    assert two.seconds(shape) == pytest.approx(one.seconds(shape) / 2 + all_reduce, rel=1e-12)
    assert two.breakdown(shape)["all_to_all"] == 0.0


def test_expert_all_to_all_only_with_ep_and_experts():
    shape = StepShape(prefill=((2048, 0),), decode=(10, 20))
    assert _model("smollm2-135m", devices=8, ep=8, dtype="bf16").breakdown(shape)["all_to_all"] == 0.0
    assert _model("glm-5.3-flash", devices=8, ep=1).breakdown(shape)["all_to_all"] == 0.0
    cfg, bw = _cfg("glm-5.3-flash"), H200.interconnect_bw
    n_moe, tokens = cfg.ffn_types.count("moe"), shape.num_tokens
    for ep in (2, 8):
        got = _model("glm-5.3-flash", devices=8, ep=ep).breakdown(shape)["all_to_all"]
        # dispatch fp8 (1 B) + combine bf16 (2 B) of each rank's 1/8 of the tokens, (ep-1)/ep of them away
        volume = tokens / 8 * cfg.num_experts_per_tok * cfg.hidden_size * (1 + 2) * (ep - 1) / ep
        assert got == pytest.approx(n_moe * (2 * 20e-6 + volume / bw), rel=1e-12)
    bf16 = _model("glm-5.3-flash", devices=8, ep=8, dtype="bf16").breakdown(shape)["all_to_all"]
    assert bf16 > got                                            # bf16 dispatch sends 2 B per value


def test_experts_per_device_do_not_depend_on_how_they_are_split():
    shape = StepShape(decode=(1000,) * 16)
    works = [_model("glm-5.3", devices=8, ep=ep).device_work(shape)["experts"] for ep in (1, 2, 8)]
    assert all(w == works[0] for w in works)
    whole = _work("glm-5.3").groups(shape)["experts"]
    assert works[0].flops == pytest.approx(whole.flops / 8) and works[0].bytes == pytest.approx(whole.bytes / 8)


def test_flash_decode_at_batch_1_on_8_h200s_is_memory_bound_with_the_hand_counted_bytes():
    cfg, work = _cfg("glm-5.3-flash"), _work("glm-5.3-flash")
    hw, devices = parse_hardware_spec("h200x8")
    model = HardwareStepCost(work, hw, ParallelLayout(devices, 8, 8), True, NO_HOST, "fp8")
    context = 100_000
    shape = StepShape(decode=(context - 1,))
    dev = model.device_work(shape)
    for g, w in dev.items():
        assert w.flops / (hw.peak(model.peak_dtype[g]) * 0.6) <= w.bytes / (hw.mem_bw * 0.8), g
    # by hand: non-expert weights / 8 except the replicated ones, one embedding row / 8, the 8
    # experts one token picks in each MoE layer spread over 8 devices, the cache rows it reads and
    # writes (replicated in the tp group), KDA state / 8
    comp = component_bytes(cfg, count_params(cfg), "fp8")
    n_moe, n_dsa, n_full = cfg.ffn_types.count("moe"), cfg.mixer_types.count("dsa"), len(cfg.full_indexer_layers)
    expert = comp["routed_experts"] / (n_moe * cfg.n_routed_experts)
    cache = cache_bytes(cfg)
    # TP_SPLIT holds the LM head (read whole, 1/8 per device) and the embedding (one row read)
    weights = (sum(comp[k] for k in TP_SPLIT) - comp["embedding"]) / 8 + sum(comp[k] for k in REPLICATED)
    weights += cfg.hidden_size * 2 / 8
    experts = n_moe * cfg.num_experts_per_tok * expert / 8
    rows = (n_dsa * attended_positions(cfg, context) * latent_row_bytes(cfg, "bf16")
            + n_full * scored_keys(cfg, context) * index_entry_bytes(cfg, "bf16") + cache.per_token("bf16"))
    state = 2 * (cache.state_recurrent + cache.state_conv) / 8
    by_hand = weights + experts + rows + state
    assert sum(w.bytes for w in dev.values()) == pytest.approx(by_hand, rel=1e-9)
    assert by_hand == pytest.approx(Roofline(cfg, Setup(hw, Layout(tp=8))).decode_step(1, context).bytes, rel=1e-9)
    gpu = sum(model.breakdown(shape)[g] for g in GROUPS)
    assert gpu == pytest.approx(by_hand / (hw.mem_bw * 0.8), rel=1e-9)


# ---- dispatch, host and the breakdown ---------------------------------------------------------

def test_graphs_cut_the_dispatch_of_a_decode_step_and_leave_prefill_eager():
    hw, _ = parse_hardware_spec("h200x8")
    graphs, eager = (_model("glm-5.3", devices=8, ep=8, graphs=g, hw=hw, host=HostAssumptions())
                     for g in (True, False))
    decode = StepShape(decode=(30_000,))
    assert graphs.seconds(decode) < eager.seconds(decode)
    assert graphs.breakdown(decode)["dispatch"] == pytest.approx(graphs.fixed_kernels * hw.graph_replay_s)
    launches = eager.fixed_kernels * hw.kernel_launch_s
    b = eager.breakdown(decode)
    assert b["dispatch"] > 0          # launch-bound: the GPU waits for the last launch
    assert sum(b[k] for k in (*GROUPS, "all_reduce", "all_to_all", "dispatch")) == pytest.approx(launches)
    mixed = StepShape(prefill=((512, 0),), decode=(30_000,))
    assert graphs.seconds(mixed) == eager.seconds(mixed)          # a step with a prefill runs eagerly
    big = StepShape(decode=(100,) * (graphs.graph_max_batch + 1))
    assert graphs.seconds(big) == eager.seconds(big)              # larger than the largest captured batch


def test_unfused_kernels_add_the_stepwork_op_counts():
    shape = StepShape(prefill=((64, 0), (64, 0)), decode=(5,))
    fused, looped = _model("tiny-flash", dtype="bf16"), _model("tiny-flash", dtype="bf16", fused_kernels=False)
    per_seq_layer, per_expert = _work("tiny-flash", "bf16").op_counts(shape)
    assert looped.kernels(shape) == fused.kernels(shape) + per_seq_layer + per_expert > fused.kernels(shape)


def test_host_time_is_per_step_plus_per_sequence():
    host = HostAssumptions(step_s=3e-3, per_seq_s=50e-6)
    shape = StepShape(prefill=((100, 0),), decode=(1, 2, 3))
    with_host, without = _model("tiny-standard", host=host, dtype="bf16"), _model("tiny-standard", dtype="bf16")
    assert with_host.seconds(shape) - without.seconds(shape) == pytest.approx(3e-3 + 4 * 50e-6, rel=1e-9)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("graphs", [True, False])
def test_breakdown_sums_to_seconds(name, graphs):
    ep = 2 if _cfg(name).n_routed_experts % 2 == 0 and _cfg(name).n_routed_experts else 1
    model = _model(name, devices=2, ep=ep, graphs=graphs, hw=H200, host=HostAssumptions())
    for shape in _random_shapes(random.Random(11), 20):
        b = model.breakdown(shape)
        assert tuple(b) == HardwareStepCost.TERMS and all(v >= 0 for v in b.values())
        assert sum(b.values()) == pytest.approx(model.seconds(shape), rel=1e-12)


# ---- sensitivity and assumptions -------------------------------------------------------------

def test_halving_mfu_slows_a_compute_bound_step_and_not_a_launch_bound_one():
    hw, _ = parse_hardware_spec("h200x8")
    prefill = StepShape(prefill=((8192, 0),))
    model = _model("glm-5.3", devices=8, ep=8, hw=hw, host=HostAssumptions())
    slow = model.scaled(mfu=0.5)
    assert slow.mfu == pytest.approx(0.3)
    for g in ("weights", "experts"):                   # compute-bound: twice the time
        assert slow.breakdown(prefill)[g] == pytest.approx(2 * model.breakdown(prefill)[g], rel=1e-12)
    b = model.breakdown(prefill)
    assert slow.seconds(prefill) >= (model.seconds(prefill) + b["weights"] + b["experts"]) * (1 - 1e-12)
    # a tiny dense model decoding one sequence eagerly waits on kernel launches, not on FLOPs
    tiny = _model("smollm2-135m", graphs=False, hw=H200, dtype="bf16")
    decode = StepShape(decode=(100,))
    assert tiny.breakdown(decode)["dispatch"] > 0
    assert tiny.scaled(mfu=0.5).seconds(decode) == tiny.seconds(decode)
    assert tiny.scaled(kernel_launch_s=2).seconds(decode) > 1.9 * tiny.seconds(decode)
    assert model.scaled(mfu=2).mfu == 1.0                               # capped at the peak


def test_scaled_multiplies_the_named_assumptions():
    hw, _ = parse_hardware_spec("h200x8")
    model = _model("glm-5.3-flash", devices=8, ep=8, hw=hw, host=HostAssumptions())
    decode, prefill = StepShape(decode=(5000,) * 8), StepShape(prefill=((4096, 0),))
    b = model.breakdown(decode)
    host2 = model.scaled(host=2).breakdown(decode)
    assert host2["host_step"] == 2 * b["host_step"] and host2["host_seqs"] == 2 * b["host_seqs"]
    assert model.scaled(graph_replay_s=0.5).breakdown(decode)["dispatch"] == pytest.approx(b["dispatch"] / 2)
    assert model.scaled(mbu=0.5).breakdown(decode)["weights"] == pytest.approx(2 * b["weights"])
    slow_link = model.scaled(interconnect_bw=0.5).breakdown(prefill)
    fast_link = model.scaled(collective_latency=1e-9, interconnect_bw=2).breakdown(prefill)
    assert slow_link["all_reduce"] > model.breakdown(prefill)["all_reduce"] > fast_link["all_reduce"]
    assert model.scaled(collective_latency=2).breakdown(decode)["all_to_all"] > b["all_to_all"]
    twice = model.scaled(host=2).scaled(host=2)
    assert twice.host.step_s == pytest.approx(4 * model.host.step_s)
    assert "x4" in {a["name"]: a for a in twice.assumptions()}["host_step_s"]["source"]
    with pytest.raises(ValueError, match="unknown assumption.*peak"):
        model.scaled(peak=2)
    with pytest.raises(ValueError, match="mfu"):
        model.scaled(mfu=0)


def test_every_assumption_has_a_value_and_a_source():
    hw, _ = parse_hardware_spec("h200x8")
    model = _model("glm-5.3-flash", devices=8, ep=8, hw=hw, host=HostAssumptions())
    rows = model.assumptions()
    names = {a["name"] for a in rows}
    for needed in ("peak_flops_fp8", "peak_flops_bf16", "mem_bw", "interconnect_bw", "mfu", "mbu",
                   "kernel_launch_s", "graph_replay_s", "host_step_s", "host_per_seq_s", "all_reduce_latency_s",
                   "all_to_all_latency_s", "tp", "ep", "kernels_per_step", "kernels_per_layer_kda",
                   "communication_overlap", "graphs"):
        assert needed in names
    for a in rows:
        assert set(a) == {"name", "value", "source"} and a["value"] is not None
        assert isinstance(a["source"], str) and a["source"].strip(), a["name"]
    values = {a["name"]: a["value"] for a in rows}
    assert values["mfu"] == hw.efficiency["mfu"] and values["interconnect_bw"] == hw.interconnect_bw
    assert values["kernels_per_step"] == model.fixed_kernels


def test_a_step_costs_microseconds_to_price():
    model = _model("glm-5.3-flash", devices=8, ep=8, hw=H200, host=HostAssumptions())
    shape = StepShape(prefill=((2048, 30_000),), decode=(1000, 5000, 40_000, 99_999))
    model.seconds(shape)
    best = min(timeit.repeat(lambda: model.seconds(shape), number=200, repeat=5)) / 200
    assert best < 150e-6, f"{best * 1e6:.0f} us per step"


def test_a_verify_step_replays_a_graph_and_each_mtp_call_adds_its_kernels():
    from flashlane.analyze.gpu_step_cost import KERNELS_PER_DRAFT_CALL

    graphs, eager = _model("glm-5.3-flash", hw=H200), _model("glm-5.3-flash", hw=H200, graphs=False)
    verify = StepShape(verify=((3, 20_000),), draft_calls=3, draft_rows=6, draft_logit_rows=3)
    plain = StepShape(decode=(20_000,))
    assert graphs.replays_graph(verify) and not eager.replays_graph(verify)
    assert graphs.kernels(verify) == graphs.kernels(plain) + 3 * KERNELS_PER_DRAFT_CALL
    b = graphs.breakdown(verify)
    assert b["draft"] > 0 and graphs.breakdown(plain)["draft"] == 0.0
    # memory-bound decode: the dense weights are read once for the four verified rows, but the
    # rows route to ~4x the distinct experts (uniform routing), so a verify step costs more than
    # one decode step and far less than four
    assert b["weights"] == pytest.approx(graphs.breakdown(plain)["weights"], rel=1e-3)
    assert b["experts"] > 3 * graphs.breakdown(plain)["experts"]
    assert graphs.seconds(plain) < graphs.seconds(verify) < 3 * graphs.seconds(plain)
