"""`flashlane analyze` on its own: torch-free, formulas, full-size presets, claims, CLI."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from flashlane.analyze import (Layout, Options, Setup, build_report, cache_bytes, count_params, decode_flops,
                               get_hardware, load_task, prefill_flops, render_text, resolve_model)
from flashlane.analyze.flops import (attended_positions, scored_keys, sum_attended, sum_scored)
from flashlane.analyze.memory import device_memory
from flashlane.analyze.roofline import Roofline
from flashlane.analyze.units import parse_token_list, parse_tokens
from flashlane.cli import analyze as cli
from flashlane.config import ConfigError, parse_config

FLASH, STD = "glm-5.3-flash", "glm-5.3"
CONTEXTS = (8 * 1024, 128 * 1024, 1024 ** 2)


@pytest.fixture(scope="module")
def flash():
    return resolve_model(FLASH).cfg


@pytest.fixture(scope="module")
def std():
    return resolve_model(STD).cfg


@pytest.fixture(scope="module")
def report():
    models = [resolve_model(FLASH), resolve_model(STD)]
    return build_report(models, Setup(get_hardware("h200")), load_task("agentic"), Options(CONTEXTS, 32))


def test_analyze_never_imports_torch():
    code = (
        "import sys, json\n"
        "from flashlane.cli import analyze as cli\n"
        "import flashlane.analyze as a\n"
        "r = a.build_report([a.resolve_model('glm-5.3-flash'), a.resolve_model('tiny-standard')],"
        " a.Setup(a.get_hardware('b200')), a.load_task(None), a.Options())\n"
        "a.render_text(r); json.dumps(r)\n"
        "assert 'torch' not in sys.modules, 'analyze imported torch'\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- units -----------------------------------------------------------------------------------

def test_token_counts_parse_k_and_m_as_powers_of_1024():
    assert parse_tokens("8k") == 8192
    assert parse_tokens("1m") == 1048576
    assert parse_tokens("3000") == 3000
    assert parse_tokens("1.5k") == 1536
    assert parse_token_list("8k,128k,1m") == [8192, 131072, 1048576]
    for bad in ("8q", "-1", "0", "1.3"):
        with pytest.raises(ValueError, match="--context"):
            parse_tokens(bad)


# ---- full-size presets -----------------------------------------------------------------------

def test_full_size_layer_plans_match_the_spec(flash, std):
    assert (flash.mixer_types.count("kda"), flash.mixer_types.count("dsa")) == (34, 11)
    assert flash.layers_of("dsa") == list(range(3, 45, 4)) and flash.mixer_types[44] == "kda"
    assert flash.index_kpool == 4 and flash.full_indexer_layers == flash.layers_of("dsa")
    assert std.full_indexer_layers == [0, 1, 2] + list(range(6, 75, 4))
    assert len(std.full_indexer_layers) == 21
    assert flash.num_mtp_layers == std.num_mtp_layers == 1
    assert (flash.ffn_types.count("dense"), std.ffn_types.count("dense")) == (3, 3)


def test_full_size_parameter_counts_reproduce_published_sizes(flash, std):
    # Published totals have 3 significant digits (320B, 744B / 753B): 1% covers rounding with
    # room for counting conventions (buffers, norms) but not a missing component (the smallest
    # ones that matter, the MTP layer and the embeddings, are 2-3% of the total).
    # Published active counts have 2 digits (18B, 40B) and differ in whether the embedding
    # table / MTP are counted (3-5% of the active count here): 5%.
    p = count_params(flash)
    assert p.total == pytest.approx(320e9, rel=0.01)           # Flash counts its MTP layer
    assert p.active == pytest.approx(18e9, rel=0.05)
    q = count_params(std)
    assert q.total_without_mtp == pytest.approx(744e9, rel=0.01)  # GLM-5.x "744B" excludes MTP
    assert q.total == pytest.approx(753e9, rel=0.01)
    assert q.active == pytest.approx(40e9, rel=0.05)
    # the bulk is routed experts; each model's active share is ~5%
    assert p.total_by["routed_experts"] / p.total > 0.9 and q.total_by["routed_experts"] / q.total > 0.9


def test_full_size_cache_bytes_match_hand_counts(flash, std):
    cf, cs = cache_bytes(flash), cache_bytes(std)
    # Flash: 11 NoPE MLA layers x 512 bf16 + 11 pooled indexer keys x 128 bf16 / 4
    assert cf.bytes_per_token["bf16"] == 11 * 512 * 2 + 11 * 128 * 2 / 4
    # GLM-5.3: 78 layers x (512 + 64) bf16 + 21 full indexers x 128 bf16 per token
    assert cs.bytes_per_token["bf16"] == 78 * 576 * 2 + 21 * 128 * 2
    # SGLang FP8 DSA format: 656 B per token per layer; indexer 128 B + 4 B scale
    assert cs.latent_per_token["fp8"] == 78 * 656 and cs.index_per_token["fp8"] == 21 * 132
    # spec 1.5: 34 KDA layers -> 136 MiB recurrent + 34 x 144 KiB conv (bf16)
    assert cf.state_recurrent == 136 * 2 ** 20
    assert cf.state_conv == 34 * 144 * 1024
    assert cs.state_per_sequence == 0
    assert cf.mtp_per_token["bf16"] == 512 * 2 + 128 * 2 / 4


# ---- FLOP formulas ---------------------------------------------------------------------------

@pytest.mark.parametrize("kpool,topk,tail", [(4, 16, True), (4, 16, False), (1, 16, False), (8, 64, True)])
def test_closed_form_sums_equal_brute_force(flash, kpool, topk, tail):
    import dataclasses

    cfg = dataclasses.replace(flash, index_kpool=kpool, index_topk=topk, index_always_select_tail=tail)
    for n in (1, 3, topk - 1, topk, topk + 1, topk + kpool, 5 * topk + 3):
        assert sum_attended(cfg, n) == sum(attended_positions(cfg, t) for t in range(1, n + 1))
        assert sum_scored(cfg, n) == sum(scored_keys(cfg, t) for t in range(1, n + 1))
    # everything visible is attended up to topk; then topk plus the incomplete pool's tail
    assert [attended_positions(cfg, t) for t in (1, topk)] == ([1, topk] if tail or kpool == 1 else
                                                               [0, topk])
    assert attended_positions(cfg, topk + kpool + 1) == topk + (1 if tail and kpool > 1 else 0)


def test_prefill_context_terms_are_sums_of_decode_terms(flash, std):
    for cfg in (flash, std):
        n, c = 300, 50
        pf = prefill_flops(cfg, n, cached=c)
        ts = range(c + 1, c + n + 1)
        assert pf.indexer_scoring == sum(decode_flops(cfg, t).indexer_scoring for t in ts)
        assert pf.sparse_attention == sum(decode_flops(cfg, t).sparse_attention for t in ts)
        assert pf.projections == n * decode_flops(cfg, 1).projections
        assert pf.head == decode_flops(cfg, 1).head   # logits of the last token only


def test_llama_decode_flops_by_hand():
    cfg = parse_config(dict(model_type="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    t = 77
    f = decode_flops(cfg, t)
    hd = 16
    assert f.projections == 3 * 2 * (64 * 4 * hd * 2 + 64 * 2 * hd * 2)
    assert f.ffn == 3 * 2 * 3 * 64 * 128
    assert f.sparse_attention == 3 * 4 * 4 * hd * t       # QK^T and PV over all t positions
    assert f.head == 2 * 1000 * 64
    assert f.indexer_scoring == f.kda_recurrence == f.mhc == 0
    assert prefill_flops(cfg, 10).sparse_attention == 3 * 4 * 4 * hd * 55


def test_attention_grows_with_context_but_kda_and_projections_do_not(flash):
    a, b = decode_flops(flash, 8192), decode_flops(flash, 1024 ** 2)
    assert a.kda_recurrence == b.kda_recurrence and a.projections == b.projections
    assert a.sparse_attention == b.sparse_attention          # both beyond topk: 2048 positions
    assert b.indexer_scoring == pytest.approx(a.indexer_scoring * 128)   # pools grow linearly
    with pytest.raises(ValueError, match="context"):
        decode_flops(flash, 0)


# ---- memory and roofline ---------------------------------------------------------------------

def test_memory_per_device_layout(flash, std):
    h200 = get_hardware("h200")
    pf, pb = count_params(flash), count_params(std)
    m8 = device_memory(flash, pf, cache_bytes(flash), Layout(8, 1), h200.mem_bytes, "fp8")
    m4 = device_memory(flash, pf, cache_bytes(flash), Layout(4, 1), h200.mem_bytes, "fp8")
    assert 1.8 * m8.weights < m4.weights <= 2 * m8.weights and m8.fits   # all but replicated bits halve
    # GLM-5.3 in bf16 (~1.5 TB) cannot fit 8 x 141 GB; in fp8 it does
    assert not device_memory(std, pb, cache_bytes(std), Layout(8, 1), h200.mem_bytes, "bf16").fits
    assert device_memory(std, pb, cache_bytes(std), Layout(8, 1), h200.mem_bytes, "fp8").fits
    # a Flash sequence's fixed KDA state outweighs the cache of its first 1k tokens
    assert m8.state_per_sequence > 1024 * m8.kv_per_token
    assert m8.max_sequences(1024) == int(m8.free // (1024 * m8.kv_per_token + m8.state_per_sequence))
    with pytest.raises(ValueError, match="tp"):
        Layout(0, 1)


def test_roofline_regimes(flash):
    r = Roofline(flash, Setup(get_hardware("h200")))
    one = r.decode_step(1, 8192)
    assert one.bound == "memory"
    assert r.decode_step(64, 8192).seconds < 64 * one.seconds          # batching amortises weights
    assert r.prefill(128 * 1024).bound == "compute"
    assert r.distinct_experts(1) == pytest.approx(8) and r.distinct_experts(10 ** 6) == pytest.approx(288)
    exact = sum(r.decode_step(4, 5000 + j).seconds for j in range(1, 301))
    assert r.decode_seconds(4, 5000, 300) == pytest.approx(exact, rel=1e-3)     # trapezoid over contexts
    task = load_task("turns=3,prefix=1k,in=100,out=50")
    c1, c4 = r.task(task, 1), r.task(task, 4)
    assert c4["tasks_per_hour"] > c1["tasks_per_hour"] and c4["latency_s"] > c1["latency_s"]
    cheap = Roofline(flash, Setup(get_hardware("h200", usd_per_hour=1.0))).task(task, 1)
    assert cheap["usd_per_task"] == pytest.approx(c1["usd_per_task"] / 3.5)
    with pytest.raises(ValueError, match="mfu"):
        Setup(get_hardware("h200"), mfu=0)


def test_mtp_speculative_decode_pays_a_verify_step_and_the_mtp_pass_per_accepted_length(flash, std):
    from flashlane.acceptance import assumed_length, rate_for_length

    r = Roofline(flash, Setup(get_hardware("h200"), Layout(tp=8)))
    plain, verify = r.decode_step(1, 8192), r.verify_step(1, 8192, 3)
    assert r.verify_step(1, 8192, 0).seconds == pytest.approx(plain.seconds)     # no drafts: a decode step
    assert plain.seconds < verify.seconds < 4 * plain.seconds        # weights once, experts of 4 tokens
    assert verify.flops == pytest.approx(4 * plain.flops)
    mtp = r.mtp_pass(1, 3)
    assert mtp.bytes == pytest.approx(3 * r.mtp_pass(1, 1).bytes) and mtp.seconds > 0
    spec = r.speculative_decode(1, 8192, 3, 2.99)
    assert spec["step_s"] == pytest.approx(verify.seconds + mtp.seconds)
    assert spec["speedup"] == pytest.approx(2.99 / spec["step_s"] * plain.seconds)
    # more tokens per step pay off at batch: the dense weights are shared by more rows
    assert r.speculative_decode(32, 8192, 3, 2.99)["speedup"] > spec["speedup"] > 1.0
    assert assumed_length(3) == pytest.approx(2.99) and 1 < assumed_length(1) < assumed_length(2) < 2.99
    assert rate_for_length(4.0, 3) == pytest.approx(1.0) and rate_for_length(1.0, 3) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="no MTP layer"):
        Roofline(parse_config(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
                 Setup(get_hardware("h200"))).mtp_pass(1, 3)


def test_local_hardware_is_measured():
    from flashlane.analyze.hardware import measure_local

    hw = measure_local(seconds=0.05)
    assert hw.peak("bf16") > 1e6 and hw.mem_bw > 1e6 and hw.mem_bytes > 0
    with pytest.raises(ValueError, match="--hardware"):
        get_hardware("tpu-v9")


def test_a_hardware_without_a_price_reports_no_cost_instead_of_crashing():
    from flashlane.analyze.hardware import measure_local

    models = [resolve_model(FLASH), resolve_model(STD)]
    local = measure_local(seconds=0.05)
    assert not local.usd_per_hour
    out = build_report(models, Setup(local), load_task("agentic"), Options(CONTEXTS, 32))
    cost = next(c for c in out["claims"] if c["claim"].startswith("cost per task"))
    assert "has no price" in cost["verdict"]
    assert "no price" in render_text(out)


def test_task_profiles(tmp_path):
    p = load_task("turns=2,prefix=1k,in=10,out=5")
    assert [(t.new_tokens, t.cached, t.output) for t in p.turns] == [(1034, 0, 5), (10, 1039, 5)]
    trace = {"block_size": 4, "requests": [
        {"in": 8, "out": 2, "hash_ids": [1, 2]},
        {"type": "subagent", "requests": [{"in": 4, "out": 1, "hash_ids": [7]}]},
        {"in": 12, "out": 3, "hash_ids": [1, 2, 3]},
    ]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    t = load_task(str(path))
    assert [(x.new_tokens, x.cached, x.output) for x in t.turns] == [(8, 0, 2), (4, 0, 1), (4, 8, 3)]
    path.write_text(json.dumps({"requests": [{"in": 3}]}))
    with pytest.raises(ValueError, match="'out'"):
        load_task(str(path))
    with pytest.raises(ValueError, match="--task"):
        load_task("turns=2,bogus=1")


# ---- report, claims, JSON --------------------------------------------------------------------

def test_json_has_the_stable_keys(report):
    assert [m["name"] for m in report["models"]] == [FLASH, STD]
    keys = [str(t) for t in CONTEXTS]
    for m in report["models"]:
        assert isinstance(m["params"]["total"], int) and isinstance(m["params"]["active"], int)
        assert set(m["cache"]["bytes_per_token"]) == {"bf16", "fp8", "int8"}
        assert isinstance(m["state"]["bytes_per_sequence"], int)
        assert list(m["flops"]["attention_per_token"]) == keys
        assert list(m["flops"]["total_per_token"]) == keys
        spec = m["roofline"]["speculative_mtp"]           # both GLM models draft with their MTP layer
        assert list(spec) == keys and spec[keys[0]]["batch1"]["drafts"] == 3
    r = report["ratios"]
    assert r["params"]["total"] == pytest.approx(report["models"][1]["params"]["total"] /
                                                 report["models"][0]["params"]["total"])
    assert set(r["cache"]["bytes_per_token"]) == {"bf16", "fp8", "int8"}
    assert list(r["flops"]["attention_per_token"]) == keys
    json.dumps(report)


def _claim(report, start):
    return next(c for c in report["claims"] if c["claim"].startswith(start))


def test_claims_state_their_definitions(report):
    kv = _claim(report, "4.44x")
    hits = [d["definition"] for d in kv["definitions"] if d["reproduces"]]
    assert hits and all("fp8" in d for d in hits)          # only with fp8 baseline vs bf16 Flash
    both_bf16 = kv["definitions"][0]
    assert both_bf16["values"]["-"] == pytest.approx(95232 / 11968) and not both_bf16["reproduces"]
    pool = _claim(report, "IndexPool")
    assert pool["definitions"][0]["values"]["-"] == 4 and pool["definitions"][0]["reproduces"]
    attn = _claim(report, "3.01x")
    ctx_dep = attn["definitions"][0]
    assert all(v > 6 for v in ctx_dep["values"].values()) and not ctx_dep["reproduces"]
    assert _claim(report, "18B active of 320B")["definitions"][0]["approximately"]
    assert _claim(report, "40B active of 744B")["definitions"][1]["approximately"]
    cost = _claim(report, "cost per task")
    assert cost["claimed"] == pytest.approx(6.8 / 14.4)
    assert "predicts" in cost["verdict"]


def test_text_report_is_side_by_side(report):
    text = render_text(report)
    assert "baseline/model" in text and "== public claims" in text and "== assumptions" in text
    assert "cache bytes/token bf16" in text and "7.96x" in text


def _args(*argv):
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["analyze", *argv])


def test_cli_json_and_errors(capsys):
    assert cli.run(_args("tiny-flash", "--baseline", "tiny-standard", "--context", "256,2k", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in out["models"]] == ["tiny-flash", "tiny-standard"]
    assert list(out["models"][0]["flops"]["total_per_token"]) == ["256", "2048"]
    assert cli.run(_args("no-such-model")) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert cli.run(_args(FLASH, "--context", "8x")) == 2
    assert "--context" in capsys.readouterr().err
    assert cli.run(_args(FLASH, "--hardware", "abacus")) == 2
    assert "--hardware" in capsys.readouterr().err


def test_model_ids_config_file_and_folder(tmp_path):
    from flashlane.analyze.models import full_size_preset_dict

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(full_size_preset_dict(STD)))
    assert resolve_model(str(folder)).name == "ckpt"
    assert resolve_model(str(folder / "config.json")).cfg == resolve_model(STD).cfg
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "glm_moe_dsa"}))
    with pytest.raises(ConfigError, match="num_hidden_layers|vocab_size|hidden_size"):
        resolve_model(str(tmp_path / "bad.json"))
