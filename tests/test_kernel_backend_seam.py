"""The kernel backend seam (kernels/backends): models reach kernels only through ``batch.ops``,
backends are registered and chosen by name, and the engine reports the one it runs."""

from __future__ import annotations

import argparse
import ast
import copy
from collections import Counter
from pathlib import Path

import pytest
import torch

import flashlane
from engine_models import random_prompts, small_glm, tiny_llama
from flashlane.cache_spec import cache_spec
from flashlane.engine.cache.pools import allocate_pools
from flashlane.engine.llm import LLM
from flashlane.engine.sampling_params import SamplingParams
from flashlane.kernels import backends
from flashlane.kernels.backends import CpuBackend, KernelBackend, available_backends, select_backend
from flashlane.models.forward_batch import ForwardBatch

MODELS = Path(flashlane.__file__).resolve().parent / "models"

# kernel modules a model file may still import, and why (load-time work, not ops of a forward)
ALLOWED_KERNEL_IMPORTS = {
    ("loader.py", "flashlane.kernels.cpu_caps"): "what dtype 'auto' means on this CPU (a start-up timing)",
    ("quantize.py", "flashlane.kernels.cpu_caps"): "the CPU features the int8 kernel plan is chosen for",
    ("quantize.py", "flashlane.kernels.int8_plan"): "choosing the int8 kernel per row count (timed at load)",
    ("quantize.py", "flashlane.kernels.quant_matmul"): "quantising the weights once, and the kernel names "
                                                       "FLASHLANE_INT8_KERNEL may pin",
    ("packed_linear.py", "flashlane.kernels.linear_plan"): "reordering the weights once at load (the multiply "
                                                           "goes through the backend's dense_linear)",
    ("gguf_blocks.py", "flashlane.kernels.gguf_blocks"): "checking and repacking the file's blocks once at load, "
                                                         "dequantising them for .weight (the multiply goes "
                                                         "through the backend's block_linear)",
}


def _kernel_imports(source: str, filename: str) -> set[str]:
    """Modules under ``flashlane.kernels`` but outside ``kernels.backends`` that a file in
    ``flashlane/models/`` imports (relative imports resolved, imports inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ["flashlane", "models"][: 3 - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # `from ..kernels import kda` imports a module; `from ..kernels.kda import f` its function
            names = [f"{module}.{a.name}" for a in node.names] if module == "flashlane.kernels" else [module]
        else:
            continue
        for name in names:
            in_kernels = name == "flashlane.kernels" or name.startswith("flashlane.kernels.")
            seam = name == "flashlane.kernels.backends" or name.startswith("flashlane.kernels.backends.")
            if in_kernels and not seam:
                found.add(name)
    return found


def test_the_import_check_sees_kernel_imports():
    src = ("from ..kernels.kda import kda_gate\nfrom ..kernels import moe, backends\nimport flashlane.kernels.rope\n"
           "from ..kernels.backends import select_backend\nfrom .layers import MLP\n")
    assert _kernel_imports(src, "x.py") == {"flashlane.kernels.kda", "flashlane.kernels.moe",
                                            "flashlane.kernels.rope"}


def test_models_import_no_kernel_function():
    wrong = []
    for path in sorted(MODELS.glob("*.py")):
        for name in _kernel_imports(path.read_text(), str(path)):
            if (path.name, name) not in ALLOWED_KERNEL_IMPORTS:
                wrong.append(f"models/{path.name} imports {name}")
    assert not wrong, "\n".join(wrong) + "\n(call the op through batch.ops / kernels.backends instead)"


def test_models_leave_the_decode_and_static_branches_to_the_ops():
    wrong = [f"models/{p.name}:{node.lineno} reads .{node.attr}"
             for p in sorted(MODELS.glob("*.py")) if p.name != "forward_batch.py"
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in ("static", "is_decode")]
    assert not wrong, "\n".join(wrong)


# ---- registry ------------------------------------------------------------------------------

OPS = sorted(KernelBackend.__abstractmethods__ - {"describe"})


class CountingBackend(CpuBackend):
    """The cpu kernels, counting every op call."""

    name = "counting"

    def __init__(self, device):
        super().__init__(device)
        self.calls: Counter = Counter()
        for op in OPS:
            setattr(self, op, self._counted(op, getattr(self, op)))

    def _counted(self, op, fn):
        def call(*args, **kwargs):
            self.calls[op] += 1
            return fn(*args, **kwargs)
        return call


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test (registrations here do not leak)."""
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    monkeypatch.setattr(backends, "_INSTANCES", dict(backends._INSTANCES))
    return backends


@pytest.fixture
def counting(registry):
    registry.register_backend("counting", CountingBackend, lambda device: device.type == "cpu")
    return select_backend("cpu", "counting")


def _small(arch: str):
    """Two-to-three layers of ``arch`` with every mixer and FFN kind it has, random weights."""
    return tiny_llama() if arch == "llama" else small_glm(arch)


def _logits(m, ops: KernelBackend) -> list[torch.Tensor]:
    """Three steps on a fresh cache: two prefills (one chunked), then a prefill chunk beside a
    decode step and a new sequence, then a padded (static) decode of all three."""
    page = 4
    spec = cache_spec(m.config, page)
    cache = allocate_pools(spec, 1 + 3 * 8, 4, torch.float32)
    tables = [list(range(1 + 8 * b, 9 + 8 * b)) for b in range(3)]
    slots = [1, 2, 3] if spec.needs_state_slot else [0, 0, 0]
    seqs = random_prompts(3, 14, 14, 250, seed=5)
    steps = [([0, 1], [seqs[0][:10], seqs[1][:6]], [0, 0]),
             ([0, 1, 2], [seqs[0][10:11], seqs[1][6:13], seqs[2][:5]], [10, 6, 0])]
    out = []
    with torch.no_grad():
        for ids, new, starts in steps:
            batch = ForwardBatch.build(new, starts, [tables[b] for b in ids], [slots[b] for b in ids], cache, ops=ops)
            out.append(m.model.compute_logits(m.model(batch)))
        batch = ForwardBatch.padded_decode([seqs[0][11], seqs[1][13], seqs[2][5]], [11, 13, 5], tables, slots,
                                           cache, size=4, width=8, ops=ops)
        assert batch.static
        out.append(m.model.compute_logits(m.model(batch)))
    return out


EXPECTED_OPS = {
    "llama": {"plan_attention", "dense_attention", "swiglu"},
    "glm5_next": {"kda_gate", "short_conv", "kda", "write_kv_rows", "write_index_keys", "select_positions",
                  "sparse_mla", "mhc_pre", "mhc_post", "swiglu", "route", "moe_experts"},
    "glm_moe_dsa": {"rope_cos_sin", "rope", "write_kv_rows", "write_index_keys", "select_positions", "sparse_mla",
                    "swiglu", "route", "moe_experts"},
}


@pytest.mark.parametrize("arch", list(EXPECTED_OPS))
def test_a_registered_backend_runs_every_op_and_matches_cpu(arch, counting):
    m = _small(arch)
    want = _logits(m, select_backend("cpu", "cpu"))
    got = _logits(m, counting)
    for w, g in zip(want, got):
        assert torch.equal(w, g)      # the same kernels in the same order
    assert {op for op in EXPECTED_OPS[arch] if counting.calls[op] == 0} == set()


def test_unknown_or_unavailable_backend_is_a_value_error_naming_kernel_backend(registry):
    with pytest.raises(ValueError, match=r"kernel_backend 'nope'.*known: auto, cpu"):
        select_backend("cpu", "nope")
    registry.register_backend("gpu-only", CpuBackend, lambda device: device.type == "cuda")
    with pytest.raises(ValueError, match=r"kernel_backend 'gpu-only' is not available on device cpu"):
        select_backend("cpu", "gpu-only")
    with pytest.raises(ValueError, match="kernel_backend"):
        LLM(tiny_llama(), dtype="float32", kernel_backend="nope")


def test_auto_prefers_the_highest_priority_available_backend(registry):
    assert select_backend("cpu").name == "cpu" and select_backend("cpu", "auto") is select_backend("cpu")
    registry.register_backend("fast", CountingBackend, lambda device: device.type == "cpu", priority=5)
    registry.register_backend("gpu-only", CpuBackend, lambda device: device.type == "cuda", priority=9)
    assert available_backends("cpu") == ["fast", "cpu"]
    assert isinstance(select_backend("cpu"), CountingBackend)
    assert select_backend("cpu", "cpu").name == "cpu"


# ---- engine --------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_the_engine_reports_and_runs_its_backend(counting):
    prompts = random_prompts(2, 5, 9, 250, seed=2)
    default = LLM(tiny_llama(), dtype="float32", max_num_seqs=2)
    chosen = LLM(tiny_llama(), dtype="float32", max_num_seqs=2, kernel_backend="counting")
    assert default.engine.info.kernel_backend["name"] == "cpu"
    assert chosen.engine.info.kernel_backend == {"name": "counting", "description": counting.describe()}
    assert chosen.engine.startup["kernel_backend"]["name"] == "counting"
    assert "kernel backend counting:" in chosen.engine.describe_weights()
    assert "kernel backend cpu:" in default.engine.describe_weights()
    counting.calls.clear()
    want = [o.token_ids for o in default.generate(prompts, GREEDY)]
    assert [o.token_ids for o in chosen.generate(prompts, GREEDY)] == want
    assert counting.calls["dense_attention"] > 0 and counting.calls["plan_attention"] > 0


def test_int8_linears_run_through_the_engine_backend(counting, monkeypatch):
    monkeypatch.setenv("FLASHLANE_INT8_KERNEL", "int8pack")   # no kernel timing
    llm = LLM(copy.deepcopy(tiny_llama()), dtype="float32", quantization="int8", kernel_backend="counting")
    counting.calls.clear()
    llm.generate(random_prompts(1, 5, 5, 250, seed=1), GREEDY)
    assert counting.calls["int8_linear"] > 0


def test_kernel_backend_flag():
    from flashlane.cli.engine_flags import add_engine_flags, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_kwargs(p.parse_args([]))["kernel_backend"] == "auto"
    assert engine_kwargs(p.parse_args(["--kernel-backend", "cpu"]))["kernel_backend"] == "cpu"
