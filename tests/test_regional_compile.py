"""Regional compilation of the static-graph decode: one compiled region per decoder-layer kind.

The graph counts are a property of torch.compile's guards, not of the code Inductor generates,
so these tests compile with the "eager" graph backend (seconds, no C++ build); the Inductor
path against the eager engine is test_compiled_decode. The models have repeated layers of
every kind, so a per-layer guard (layer ids, pool rows) would show up as extra graphs.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from engine_models import ByteTokenizer, random_prompts, tiny_llama
from hf_tiny import GLM5_NEXT_TINY_TEXT, GLM_MOE_DSA_TINY

from flashlane.config import parse_config
from flashlane.engine.compiled_decode import CompiledDecode, _layer_kind
from flashlane.engine.llm import LLM
from flashlane.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
SIZES = (1, 2, 4)


def _six_layers(arch: str):
    """Six layers, kinds repeated: glm5_next KDA dense / KDA MoE x3 / DSA full x2 / DSA shared;
    glm_moe_dsa dense full / MoE shared x3 / MoE full x2."""
    if arch == "glm5_next":
        from flashlane.models.glm5_next import Glm5NextForCausalLM as cls
        text = dict(GLM5_NEXT_TINY_TEXT, num_hidden_layers=6, vocab_size=256,
                    layer_types=["linear_attention", "linear_attention", "indexed_attention",
                                 "indexed_attention", "linear_attention", "indexed_attention"],
                    indexer_types=["full", "full", "full", "shared", "full", "full"],
                    mlp_layer_types=["dense"] + ["sparse"] * 5)
        raw = dict(model_type="glm5_next", text_config=dict(text, model_type="glm5_next_text"))
    else:
        from flashlane.models.glm_moe_dsa import GlmMoeDsaForCausalLM as cls
        raw = dict(GLM_MOE_DSA_TINY, model_type="glm_moe_dsa", num_hidden_layers=6, vocab_size=256,
                   indexer_types=["full", "shared", "shared", "full", "shared", "full"])
    cfg = parse_config(raw)
    torch.manual_seed(1)
    model = cls(cfg, with_mtp=False)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return SimpleNamespace(model=model.eval(), config=cfg, tokenizer=ByteTokenizer(), name=f"six-{arch}", path=None)


MODELS = {"llama": tiny_llama, "glm5_next": functools.partial(_six_layers, "glm5_next"),
          "glm_moe_dsa": functools.partial(_six_layers, "glm_moe_dsa")}
KINDS = {"llama": 1, "glm5_next": 4, "glm_moe_dsa": 3}


@functools.cache
def _engines(arch: str):
    m = MODELS[arch]()
    kw = dict(dtype="float32", page_size=16, max_num_seqs=8, num_pages=96, enable_prefix_caching=False)
    eager, compiled = LLM(m, **kw), LLM(m, **kw)
    eng = compiled.engine
    cd = CompiledDecode(eng.model, eng.cache.tensors, SIZES, eng.args.index_topk,
                        min_width=-(-(eng.index_topk or 0) // eng.cache.tensors.spec.page_size), ops=eng.ops,
                        backend="eager")
    warm = cd.warm_up()
    eng.runner.compiled = cd
    return eager, compiled, warm


def _trunk(model):
    inner = getattr(model.model, "language_model", model.model)
    return list(inner.layers)[: getattr(inner, "num_trunk_layers", len(inner.layers))]


def _has_indexer(kind: tuple) -> bool:
    return any(name.endswith("indexer") for name, _ in kind)


@pytest.mark.parametrize("arch", list(MODELS))
def test_graphs_are_bounded_by_layer_kinds_not_layers(arch):
    _, compiled, warm = _engines(arch)
    cd = compiled.engine.runner.compiled
    assert len({_layer_kind(layer) for layer in _trunk(compiled.engine.model)}) == KINDS[arch] == cd.num_kinds
    assert warm.mode == "regional" and warm.graphs == cd.num_graphs
    # a kind holds at most one graph per bucket: no layer id or pool row is guarded on
    for kind, graphs in cd.graphs_per_kind().items():
        if not _has_indexer(kind):
            assert 1 <= graphs <= len(SIZES), kind


@pytest.mark.parametrize("arch", ["glm5_next", "glm_moe_dsa"])
def test_full_indexer_layers_share_their_graphs(arch):
    cd = _engines(arch)[1].engine.runner.compiled
    assert all(graphs <= len(SIZES) for kind, graphs in cd.graphs_per_kind().items() if _has_indexer(kind))


@pytest.mark.parametrize("arch", list(MODELS))
def test_regional_decode_matches_eager_without_recompiling(arch):
    eager, compiled, warm = _engines(arch)
    cd = compiled.engine.runner.compiled
    prompts = random_prompts(3, 3, 40, 250, seed=5)
    before = sum(cd.calls.values())
    outs_e, outs_c = eager.generate(prompts, GREEDY), compiled.generate(prompts, GREEDY)
    assert sum(cd.calls.values()) - before == GREEDY.max_tokens - 1   # every decode step was compiled
    for e, c in zip(outs_e, outs_c):
        assert c.token_ids == e.token_ids
        assert max(abs(le[t] - lc[t]) for le, lc in zip(e.logprobs, c.logprobs) for t in le) < 1e-4
    assert cd.num_graphs == warm.graphs   # what warm-up compiled served every step


def test_whole_model_mode_is_one_function():
    m = tiny_llama()
    eng = LLM(m, dtype="float32", page_size=16, max_num_seqs=4, num_pages=32).engine
    cd = CompiledDecode(eng.model, eng.cache.tensors, (2,), None, ops=eng.ops, regional=False, backend="eager")
    warm = cd.warm_up()
    assert warm.mode == "whole" and cd.num_kinds == 1 and warm.graphs >= 1


def test_the_vector_isa_probe_runs_beside_the_tracing_and_leaves_inductors_answer_alone(monkeypatch):
    """Inductor's first CPU kernel waits for a test build per vector ISA, one after another; warm-up
    starts them at once on other threads. The ISA Inductor then picks is the one it picks alone,
    and where torch's private module lacks what the probe reads, nothing is started."""
    from torch._inductor import cpu_vec_isa

    from flashlane.engine.compiled_decode import probe_vector_isas

    probes = probe_vector_isas()
    assert probes is not None
    for t in probes:                           # x86: one build per ISA the CPU flags name
        t.join(timeout=300)
        assert not t.is_alive()
    if probes:
        picked = cpu_vec_isa.pick_vec_isa()
        assert picked is cpu_vec_isa.invalid_vec_isa or picked in cpu_vec_isa.valid_vec_isa_list()
    monkeypatch.delattr(cpu_vec_isa, "x86_isa_checker")
    assert probe_vector_isas() is None
