"""KV cache dtype (auto / bfloat16 / int8) and the index_topk override.

Accuracy is measured against the float32 cache of the same float32 model, on full next-token
distributions (KL(ref || quantised), mean over prompt positions) and greedy tokens. The bounds
below were measured on this machine and set with margin; random tiny models have near-uniform
distributions (entropy ~ log 4096), so their top-1 agreement is noise and KL is the measure.
"""

from __future__ import annotations

import json

import pytest
import torch

from flashlane import LLM, SamplingParams
from flashlane.analyze.cache import cache_bytes
from flashlane.cache_spec import cache_spec
from flashlane.cli.main import main as cli_main
from flashlane.engine.cache.pools import allocate_pools
from flashlane.kernels.kv_store import dequantize_int8, gather_rows, quantize_int8, write_rows

from engine_models import preset, random_prompts, tiny_llama
from paged_runner import PagedRunner

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SMOL_PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


def _llm(m, **kw):
    return LLM(m, **{"dtype": "float32", "cache_memory": 32 << 20, **kw})


def _mean_kl(ref: list[torch.Tensor], got: list[torch.Tensor]) -> torch.Tensor:
    """KL(ref || got) per position of log-prob rows [L, V], all prompts together."""
    return torch.cat([(a.exp() * (a - b)).sum(-1) for a, b in zip(ref, got)])


# ---- the int8 format --------------------------------------------------------------------------
def test_int8_rows_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g)
    x[3, 5] = 40.0                                     # an outlier only widens its own group's step
    q, s = quantize_int8(x, groups=3)
    assert q.dtype == torch.int8 and s.shape == (64, 3) and s.dtype == torch.float32
    err = (dequantize_int8(q, s, torch.float32) - x).abs().reshape(64, 3, 32)
    assert bool((err <= s[..., None] / 2 + 1e-6).all())
    assert float(s[3, 0]) > 10 * float(s[3, 1])
    zq, zs = quantize_int8(torch.zeros(2, 96), 3)      # all-zero rows: no division by zero
    assert not zq.any() and not zs.any()
    with pytest.raises(ValueError, match="multiple of 5 scale groups"):
        quantize_int8(x, groups=5)
    pool, scale = torch.zeros(10, 96, dtype=torch.int8), torch.zeros(10, 3)
    write_rows(pool, scale, torch.tensor([7, 2]), x[:2])
    back = gather_rows(pool, scale, torch.tensor([[2, 7]]), torch.float32)[0]
    assert torch.allclose(back, x[:2].flip(0), atol=float(s[:2].max()) / 2 + 1e-6)


# ---- accuracy against the float32 cache ---------------------------------------------------------
def test_smollm2_int8_cache_same_greedy_tokens_and_small_kl():
    m = preset("smollm2-135m")
    ids = m.tokenizer.encode(SMOL_PROMPT)
    want = _llm(m).generate([ids], GREEDY)[0].token_ids
    for kv in ("bfloat16", "int8"):
        assert _llm(m, kv_cache_dtype=kv).generate([ids], GREEDY)[0].token_ids == want, kv
    ref = PagedRunner(m.model, m.config, max_tokens=64, max_seqs=1).prefill([ids])
    # measured KL mean / max: bfloat16 2.5e-5 / 7.4e-5; int8 (per-head scales) 6.5e-4 / 2.3e-3
    # (one scale per token for all of [K | V]: 9.7e-3 / 5.9e-2). Bounds: 3-8x margin.
    for kv, mean_bound, max_bound in (("bfloat16", 2e-4, 5e-4), ("int8", 2e-3, 1e-2)):
        lp = PagedRunner(m.model, m.config, max_tokens=64, max_seqs=1, kv_cache_dtype=kv).prefill([ids])
        kl = _mean_kl(ref, lp)
        assert kl.mean() < mean_bound and kl.max() < max_bound, (kv, kl.mean(), kl.max())
        assert bool((ref[0].argmax(-1) == lp[0].argmax(-1)).all()), kv


# tiny-flash: measured KL mean <= 4e-6 (both dtypes, 100-140 token prompts, chunked prefill);
# tiny-standard: its MoE routing flips under any perturbation, measured KL mean <= 0.02 for
# bfloat16 and int8 alike, against 0.12 between the distributions of neighbouring positions.
KL_BOUND = {"tiny-flash": 1e-4, "tiny-standard": 0.05}


@pytest.mark.parametrize("name", ["tiny-flash", "tiny-standard"])
def test_tiny_models_quantised_cache_close_to_float32(name):
    m = preset(name)
    prompts = random_prompts(2, 40, 60, 4000, seed=3)      # < index_topk: selection is not in play
    ref_runner = PagedRunner(m.model, m.config, max_tokens=256, max_seqs=2)
    ref = ref_runner.prefill(prompts, chunk=32)
    unrelated = torch.cat([(a[:-1].exp() * (a[:-1] - a[1:])).sum(-1) for a in ref]).mean()
    assert unrelated > 2 * KL_BOUND[name]                   # the bound can tell distributions apart
    ref_tokens = ref_runner.greedy(prompts, 8, chunk=32) if name == "tiny-flash" else None
    for kv in ("bfloat16", "int8"):
        runner = PagedRunner(m.model, m.config, max_tokens=256, max_seqs=2, kv_cache_dtype=kv)
        kl = _mean_kl(ref, runner.prefill(prompts, chunk=32))
        assert kl.mean() < KL_BOUND[name], (kv, kl.mean())
        if ref_tokens is not None:
            assert runner.greedy(prompts, 8, chunk=32) == ref_tokens, kv


# ---- bytes: cache_spec == analyze == what is allocated -------------------------------------------
def _configs():
    return {"tiny-llama": tiny_llama().config, **{n: preset(n).config for n in ("tiny-flash", "tiny-standard")}}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-flash", "tiny-standard"])
def test_bytes_per_token_spec_analyze_and_allocation_agree(name):
    cfg = _configs()[name]
    page = 16
    fp32, bf16, int8 = (cache_spec(cfg, page, kv).bytes_per_token("float32") for kv in ("auto", "bfloat16", "int8"))
    assert int8 < bf16 < fp32 == 2 * bf16
    analyzed = cache_bytes(cfg, "float32")
    for fmt, kv in (("bf16", "bfloat16"), ("int8", "int8")):
        spec = cache_spec(cfg, page, kv)
        assert analyzed.per_token(fmt) == spec.bytes_per_token("float32")
        assert analyzed.pool_per_token[fmt] == spec.page_bytes_per_token("float32")
    spec = cache_spec(cfg, page, "int8")
    assert {"latent_scale"} <= {p.name for p in spec.pools()}
    cache = allocate_pools(spec, 5, 3 if spec.needs_state_slot else 0, torch.float32)
    for p in spec.pools():
        units = 5 if p.unit == "page" else 3
        assert cache.pools[p.name].nbytes == p.bytes_per_unit("float32") * units, p.name
    assert cache.latent.dtype == torch.int8 and cache.latent_scale.dtype == torch.float32
    assert cache.nbytes() == 5 * spec.bytes_per_page("float32") + (3 * spec.bytes_per_slot("float32")
                                                                  if spec.needs_state_slot else 0)


def test_engine_report_and_analyze_cli_show_int8_pools(capsys):
    m = preset("tiny-flash")
    llm = _llm(m, kv_cache_dtype="int8")
    s = llm.engine.startup
    spec = cache_spec(m.config, 16, "int8")
    assert s["kv_cache_dtype"] == "int8" and s["pool_bytes_per_token"] == spec.page_bytes_per_token("float32")
    assert s["cache_bytes"] == llm.engine.cache.tensors.nbytes()
    line = llm.engine.describe_cache()
    assert "kv int8" in line and "latent_scale 8" in line and "= 90 B/token" in line
    assert _llm(m).engine.startup["kv_cache_dtype"] == "float32"
    assert cli_main(["analyze", "tiny-flash", "--kv-cache-dtype", "int8", "--json", "--context", "8k"]) == 0
    report = json.loads(capsys.readouterr().out)["models"][0]
    assert report["cache"]["pool_bytes_per_token"]["int8"] == s["pool_bytes_per_token"]
    assert report["cache"]["bytes_per_token"]["int8"] == sum(s["pool_bytes_per_token"].values())
    assert cli_main(["analyze", "tiny-flash", "--kv-cache-dtype", "int8", "--context", "8k"]) == 0
    assert "pool latent_scale bytes/token int8" in capsys.readouterr().out


# ---- the prefix cache with int8 pages -----------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-flash"])
def test_prefix_cache_hit_with_int8_equals_uncached(name):
    m = tiny_llama() if name == "tiny-llama" else preset(name)
    vocab = min(m.config.vocab_size, 4000)
    system = random_prompts(1, 70, 70, vocab, seed=21)[0]
    prompts = [system + t for t in random_prompts(3, 5, 20, vocab, seed=22)]
    want = [o.token_ids for o in _llm(m, kv_cache_dtype="int8", enable_prefix_caching=False).generate(prompts, GREEDY)]
    cached = _llm(m, kv_cache_dtype="int8")
    got = [cached.generate([p], GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in got] == want
    assert all(o.num_cached_tokens >= 64 for o in got[1:])


def test_int8_pages_and_scales_move_together_through_tiers(tmp_path):
    m = preset("tiny-flash")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tight = dict(num_pages=8, num_slots=2, num_checkpoints=2, max_num_seqs=2, kv_cache_dtype="int8")
    sessions = random_prompts(2, 70, 80, 4000, seed=31)        # the pool (8 pages) holds one session
    want = [o.token_ids for o in _llm(m, kv_cache_dtype="int8", enable_prefix_caching=False).generate(sessions, params)]

    host = _llm(m, host_cache_memory=16 << 20, **tight)
    assert set(host.engine.cache.export_page(1)) == {"latent", "latent_scale", "index_keys", "index_keys_scale"}
    for _ in range(2):                        # the other session's pages spill to the host tier
        assert [host.generate([p], params)[0].token_ids for p in sessions] == want
    assert host.engine.stats()["prefix_cache_hits_host"] > 0

    disk = _llm(m, disk_cache_dir=str(tmp_path), **tight)
    assert [disk.generate([p], params)[0].token_ids for p in sessions] == want
    disk.close()
    fresh = _llm(m, disk_cache_dir=str(tmp_path), **tight)
    out = fresh.generate([sessions[0]], params)[0]
    assert out.token_ids == want[0] and fresh.engine.stats()["prefix_cache_hits_disk"] > 0
    # a float32 cache (or another index_topk) keys its pages elsewhere: it never reads int8 pages
    for other in (dict(kv_cache_dtype="auto"), dict(index_topk=32)):
        llm = _llm(m, disk_cache_dir=str(tmp_path), **{**tight, **other})
        assert llm.generate([sessions[0]], params)[0].num_cached_tokens == 0
        assert llm.engine.stats()["prefix_cache_hits_disk"] == 0
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 3


# ---- index_topk ---------------------------------------------------------------------------------
def _prompt_logprobs(llm, prompt):
    """Log-prob of every prompt token after the first, given the tokens before it."""
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    return [next(iter(d.values())) for d in out.prompt_logprobs[1:]]


@pytest.mark.parametrize("name, small", [("tiny-standard", 1), ("tiny-flash", 4)])
def test_index_topk_override_changes_selection(name, small):
    m = preset(name)
    prompt = random_prompts(1, 160, 160, 4000, seed=41)[0]      # longer than the config's 64
    base = _llm(m, enable_prefix_caching=False)
    same = _llm(m, enable_prefix_caching=False, index_topk=m.config.index_topk)
    sparse = _llm(m, enable_prefix_caching=False, index_topk=small)
    ref = _prompt_logprobs(base, prompt)
    assert _prompt_logprobs(same, prompt) == ref
    got = _prompt_logprobs(sparse, prompt)
    # while no more than ``small`` tokens are visible both select everything (got[i] scores token i + 1)
    assert max(abs(a - b) for a, b in zip(got[:small], ref[:small])) < 1e-5
    assert max(abs(a - b) for a, b in zip(got[64:], ref[64:])) > 1e-2
    assert _prompt_logprobs(base, prompt) == ref       # engines do not share the override
    assert sparse.engine.startup["index_topk"] == small and base.engine.startup["index_topk"] == 64
    assert f"index_topk={small} (config 64)" in sparse.engine.describe_cache()


def test_index_topk_validation(capsys):
    with pytest.raises(ValueError, match="index_topk must be an integer >= 1"):
        LLM(preset("tiny-standard"), dtype="float32", index_topk=0)
    with pytest.raises(ValueError, match="index_topk is set, but this llama model has no sparse-attention indexer"):
        LLM(tiny_llama(), index_topk=8)
    with pytest.raises(ValueError, match=r"index_topk \(6\) must be a multiple of the model's index_kpool \(4\)"):
        LLM(preset("tiny-flash"), dtype="float32", index_topk=6)
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, bfloat16 or int8"):
        LLM(tiny_llama(), kv_cache_dtype="fp8")
    for bad, why in ((["--index-topk", "0"], "argument --index-topk: must be >= 1"),
                     (["--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: invalid choice")):
        with pytest.raises(SystemExit) as exc:
            cli_main(["generate", "--model", "tiny-flash", "--prompt", "hi", *bad])
        assert exc.value.code == 2 and why in capsys.readouterr().err
