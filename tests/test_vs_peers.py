"""The pure parts of the peer benchmarks (benchmarks/peers.py, vs_vllm_cpu.py, vs_llama_cpp.py):
argument checks, ABBA order, goal arithmetic, JSON shape. No peer is installed or started."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import peers
import vs_llama_cpp
import vs_vllm_cpu

# ---- peers.py ------------------------------------------------------------------------------

def test_peers_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHLANE_PEERS", str(tmp_path / "p"))
    assert peers.peers_root() == tmp_path / "p"
    assert peers.venv_python("vllm") == tmp_path / "p" / "vllm" / "bin" / "python"
    assert peers.venv_dir("llamacpp") == tmp_path / "p" / "llamacpp"
    monkeypatch.delenv("FLASHLANE_PEERS")
    assert peers.peers_root() == Path("~/.cache/flashlane/peers").expanduser()


def test_unknown_peer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown peer"):
        peers.venv_dir("sglang", tmp_path)


def test_missing_peers_report_none(tmp_path):
    assert peers.vllm_version(tmp_path) is None
    assert peers.llamacpp_version(tmp_path) is None
    assert peers.vllm_libiomp(tmp_path) is None
    assert peers.info(tmp_path)["hf_folder"] is None


def test_vllm_env_has_the_workarounds(tmp_path):
    lib = tmp_path / "vllm" / "lib" / "python3.11" / "site-packages" / "torch" / "lib" / "libiomp5.so"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")
    tc = tmp_path / "libtcmalloc_minimal.so.4"
    tc.write_bytes(b"")
    assert peers.vllm_env(3, tmp_path, base={}, tcmalloc_paths=(str(tmp_path / "none.so"), str(tc)))[
        "LD_PRELOAD"] == f"{tc}:{lib}"
    env = peers.vllm_env(3, tmp_path, base={"LD_PRELOAD": "/x.so", "PATH": "/bin"}, tcmalloc_paths=())
    assert env["LD_PRELOAD"] == f"{lib}:/x.so"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["OMP_NUM_THREADS"] == "3"
    assert env["PATH"] == "/bin"


def test_vllm_env_without_libiomp_sets_no_preload(tmp_path):
    assert "LD_PRELOAD" not in peers.vllm_env(1, tmp_path, base={}, tcmalloc_paths=())


def test_llamacpp_build_is_an_avx2_baseline():
    args = peers.LLAMACPP_CMAKE_ARGS.split()
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX2=ON" in args


def test_hf_folder_is_ready_only_when_complete(tmp_path):
    folder = peers.hf_folder(tmp_path)
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("{}")
    assert not peers.hf_ready(folder)  # no source.json: a conversion that did not finish
    (folder / "source.json").write_text("{}")
    assert peers.hf_ready(folder)


def test_setup_cli_refuses_an_unknown_peer(capsys):
    with pytest.raises(SystemExit):
        peers.main(["setup", "sglang"])
    assert "invalid choice" in capsys.readouterr().err


# ---- ABBA order ----------------------------------------------------------------------------

@pytest.mark.parametrize("mod", [vs_vllm_cpu, vs_llama_cpp])
def test_abba_order(mod):
    a, b = mod.SIDES
    assert mod.abba(4) == [(0, a), (0, b), (1, b), (1, a), (2, a), (2, b), (3, b), (3, a)]
    order = [s for _, s in mod.abba(6)]
    # every side runs first in half the rounds and each round has both sides once
    assert order.count(a) == order.count(b) == 6
    assert sum(1 for i in range(0, 12, 2) if order[i] == a) == 3


@pytest.mark.parametrize("mod", [vs_vllm_cpu, vs_llama_cpp])
def test_abba_needs_a_round(mod):
    with pytest.raises(ValueError):
        mod.abba(0)


# ---- argument checks -----------------------------------------------------------------------

def test_vllm_args_defaults_and_quick():
    assert vs_vllm_cpu.parse_args([]).rounds == 6
    quick = vs_vllm_cpu.parse_args(["--quick"])
    assert quick.rounds == 2 and quick.quick
    assert vs_vllm_cpu.parse_args(["--workloads", "fixed_c1,agentic_c1"]).workloads == ["fixed_c1", "agentic_c1"]


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--threads", "0"], ["--workloads", "fixed_c2"],
                                  ["--dtype", "float16"]])
def test_vllm_args_refused(argv):
    with pytest.raises(SystemExit):
        vs_vllm_cpu.parse_args(argv)


def test_llama_args_defaults_and_quick():
    args = vs_llama_cpp.parse_args([])
    assert (args.rounds, args.new_tokens) == (8, 128)
    quick = vs_llama_cpp.parse_args(["--quick"])
    assert (quick.rounds, quick.new_tokens) == (2, 16)


def test_llama_weights_requantised_once_and_kept(tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    src = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    values = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    packed = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    monkeypatch.setenv("FLASHLANE_CACHE", str(tmp_path / "cache"))
    out = vs_llama_cpp.requantized(src, "F32")
    assert out == tmp_path / "cache" / "gguf" / "tiny.F32.gguf"
    tensors = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    up = tensors["blk.0.ffn_up.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.F32
    want = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(np.asarray(up.data).reshape(want.shape), want)     # the same weights, unpacked
    stamp = out.stat().st_mtime_ns
    assert vs_llama_cpp.requantized(src, "F32").stat().st_mtime_ns == stamp  # cached, not written again
    assert not list(out.parent.glob("*.part"))


def test_llama_args_pair_weights():
    args = vs_llama_cpp.parse_args(["--quantization", "int8", "--llama-weights", "Q8_0"])
    assert (args.quantization, args.llama_weights) == ("int8", "Q8_0")
    assert (vs_llama_cpp.parse_args([]).quantization, vs_llama_cpp.parse_args([]).llama_weights) == (None, "shipped")


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--new-tokens", "1"], ["--threads", "0"],
                                  ["--llama-weights", "Q2_K"], ["--quantization", "int4"]])
def test_llama_args_refused(argv):
    with pytest.raises(SystemExit):
        vs_llama_cpp.parse_args(argv)


def test_workloads_cover_the_goals():
    for quick in (False, True):
        wls = {w.name: w for w in vs_vllm_cpu.workloads(quick)}
        for wl, metric in vs_vllm_cpu.GOALS:
            assert metric in wls[wl].metrics
        c8 = wls["fixed_c8"].bench_args
        assert c8[c8.index("--concurrency") + 1] == "8"


# ---- server commands -----------------------------------------------------------------------

def test_both_servers_get_the_same_dtype_and_folder(tmp_path):
    fl = vs_vllm_cpu.flashlane_command(tmp_path, 8001, "bfloat16", 3, [])
    vl = vs_vllm_cpu.vllm_command(Path("/v/bin/python"), tmp_path, 8002, "bfloat16", [])
    for cmd in (fl, vl):
        assert cmd[cmd.index("--model") + 1] == str(tmp_path)
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
        assert cmd[cmd.index("--served-model-name") + 1] == vs_vllm_cpu.SERVED_NAME
    assert fl[fl.index("--num-threads") + 1] == "3"
    assert vl[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]


# ---- metrics and goal arithmetic -----------------------------------------------------------

def test_metric_value_reads_a_bench_summary():
    summary = {"throughput": {"output_tok_s": 40.0}, "itl_s": {"mean": 0.05}, "task_latency_s": {"mean": None}}
    assert vs_vllm_cpu.metric_value(summary, "output_tok_s") == 40.0
    assert vs_vllm_cpu.metric_value(summary, "itl_mean_s") == 0.05
    assert vs_vllm_cpu.metric_value(summary, "task_latency_mean_s") is None
    assert vs_vllm_cpu.metric_value({}, "output_tok_s") is None


def test_advantage_is_oriented_so_higher_means_flashlane_is_better():
    # flashlane twice the throughput: 2x; flashlane half the latency: also 2x
    rate = vs_vllm_cpu.flashlane_advantage([20.0, 40.0], [10.0, 20.0], "output_tok_s")
    lat = vs_vllm_cpu.flashlane_advantage([0.5, 1.0], [1.0, 2.0], "itl_mean_s")
    assert math.isclose(rate["ratio"], 2.0) and math.isclose(lat["ratio"], 2.0)


def test_goal_check_arithmetic():
    ok = vs_vllm_cpu.goal_check({"ratio": 1.1, "low": 1.02, "high": 1.2})
    assert ok["meets_goal"] and not ok["meets_aim"] and ok["confident"]
    unsure = vs_vllm_cpu.goal_check({"ratio": 1.4, "low": 0.9, "high": 2.0})
    assert unsure["meets_goal"] and unsure["meets_aim"] and not unsure["confident"]
    short = vs_vllm_cpu.goal_check({"ratio": 0.95, "low": 0.9, "high": 1.0})
    assert not short["meets_goal"] and not short["confident"]
    assert vs_vllm_cpu.goal_check(None)["meets_goal"] is None


def _rows(fl_tok, vl_tok, fl_itl, vl_itl, fl_task, vl_task):
    rows = []
    for r, side in vs_vllm_cpu.abba(len(fl_tok)):
        pick = 0 if side == "flashlane" else 1
        rows += [
            {"round": r, "side": side, "workload": "fixed_c1", "valid": True,
             "metrics": {"output_tok_s": (fl_tok, vl_tok)[pick][r], "itl_mean_s": (fl_itl, vl_itl)[pick][r]}},
            {"round": r, "side": side, "workload": "fixed_c8", "valid": True,
             "metrics": {"output_tok_s": 3 * (fl_tok, vl_tok)[pick][r]}},
            {"round": r, "side": side, "workload": "agentic_c1", "valid": True,
             "metrics": {"task_latency_mean_s": (fl_task, vl_task)[pick][r]}},
        ]
    return rows


def test_compare_pairs_rounds_and_checks_goals():
    rows = _rows([13.0, 12.0, 13.5], [10.0, 10.0, 10.0], [0.07, 0.08, 0.07], [0.1, 0.1, 0.1],
                 [10.0, 11.0, 10.0], [9.0, 9.0, 9.0])
    comp = vs_vllm_cpu.compare(rows)
    c1 = comp["fixed_c1.output_tok_s"]
    assert c1["rounds"] == [0, 1, 2] and c1["flashlane"] == [13.0, 12.0, 13.5] and c1["vllm"] == [10.0] * 3
    assert math.isclose(c1["paired_ratio"]["ratio"], (1.3 * 1.2 * 1.35) ** (1 / 3))
    assert comp["fixed_c1.itl_mean_s"]["check"]["meets_goal"]
    assert not comp["agentic_c1.task_latency_mean_s"]["check"]["meets_goal"]  # flashlane slower per task
    g = vs_vllm_cpu.goals(comp)
    assert set(g["checks"]) == {f"{w}.{m}" for w, m in vs_vllm_cpu.GOALS}
    assert g["all_meet_goal"] is False and g["all_meet_aim"] is False
    json.dumps(g)  # the JSON shape: plain types only


def test_compare_drops_invalid_runs_and_incomplete_rounds():
    rows = _rows([13.0, 12.0], [10.0, 10.0], [0.07, 0.08], [0.1, 0.1], [8.0, 8.0], [9.0, 9.0])
    rows[0]["valid"] = False            # round 0, flashlane, fixed_c1: an invalid run
    comp = vs_vllm_cpu.compare(rows)
    one = comp["fixed_c1.output_tok_s"]
    assert one["rounds"] == [1] and one["paired_ratio"]["n_pairs"] == 1
    assert math.isclose(one["check"]["ratio"], 1.2) and one["check"]["confident"] is False
    assert comp["fixed_c8.output_tok_s"]["paired_ratio"]["n_pairs"] == 2


def test_compare_with_nothing_paired_has_no_verdict():
    rows = [{"round": 0, "side": "flashlane", "workload": "fixed_c1", "valid": True,
             "metrics": {"output_tok_s": 10.0, "itl_mean_s": 0.1}}]
    g = vs_vllm_cpu.goals(vs_vllm_cpu.compare(rows))
    assert g["all_meet_goal"] is None and g["checks"]["fixed_c1.output_tok_s"]["meets_goal"] is None


def test_llama_summary_ratio_and_goal():
    rows = [{"round": r, "side": s, "decode_tok_s": (30.0 if s == "flashlane" else 20.0) + r}
            for r, s in vs_llama_cpp.abba(3)]
    out = vs_llama_cpp.summarise(rows)
    assert out["rounds"] == [0, 1, 2]
    assert math.isclose(out["paired_ratio"]["ratio"], (30 / 20 * 31 / 21 * 32 / 22) ** (1 / 3))
    assert out["check"]["meets_goal"] and out["check"]["goal"] == 1.0
    json.dumps(out)


def test_llama_summary_skips_a_round_with_a_failed_side():
    rows = [{"round": 0, "side": "flashlane", "decode_tok_s": 10.0},
            {"round": 0, "side": "llama_cpp", "decode_tok_s": None},
            {"round": 1, "side": "llama_cpp", "decode_tok_s": 20.0},
            {"round": 1, "side": "flashlane", "decode_tok_s": 10.0}]
    out = vs_llama_cpp.summarise(rows)
    assert out["rounds"] == [1] and not out["check"]["meets_goal"]
    assert vs_llama_cpp.summarise([])["check"]["meets_goal"] is None


def test_round_prompts_differ_between_rounds():
    assert vs_llama_cpp.round_prompt(0) != vs_llama_cpp.round_prompt(1)
