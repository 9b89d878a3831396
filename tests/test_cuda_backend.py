"""The cuda kernel backend (kernels/backends/cuda) where no GPU is: how it is chosen, the errors
that name what is missing, and its mapping onto fla's KDA kernels checked on CPU tensors.

fla's ``fused_recurrent_kda`` runs on CPU in Triton's interpreter (``TRITON_INTERPRET=1``, read
when fla's kernels are defined, so the check runs in a child process that sets it before importing
fla). ``chunk_kda`` does not run there: its own check is benchmarks/cuda_check.py on a GPU; here
the backend's prefill mapping is run with ``fused_recurrent_kda`` (same call, same math) in its place.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_models import tiny_llama

from flashlane.engine.llm import LLM
from flashlane.kernels import backends
from flashlane.kernels.backends import available_backends, known_backends, select_backend
from flashlane.kernels.backends.cuda import backend as cuda_backend

ROOT = Path(__file__).resolve().parents[1]
FLA_MISSING = next((f"the optional package {dist} (module {mod}) is not installed ('flashlane[cuda]')"
                    for mod, dist in (("fla", "fla-core"), ("triton", "triton"))
                    if importlib.util.find_spec(mod) is None), None)


@pytest.fixture
def probes(monkeypatch):
    """The cuda backend's checks with their caches emptied, restored after the test."""
    monkeypatch.setattr(backends, "_INSTANCES", dict(backends._INSTANCES))
    cached = (cuda_backend._fla_not_found, cuda_backend._fla_import_error)
    for f in cached:
        f.cache_clear()
    yield monkeypatch
    for f in cached:          # what a test found under its patches is not kept
        f.cache_clear()


# ---- selection ------------------------------------------------------------------------------

def test_auto_is_cpu_without_a_gpu_and_cuda_is_known(probes):
    probes.setattr(torch.cuda, "is_available", lambda: False)         # as here (and on a GPU machine too)
    assert "cuda" in known_backends()
    assert available_backends("cpu") == ["cpu"] and available_backends("cuda") == ["cpu"]
    assert select_backend("cpu").name == "cpu" and select_backend("cuda").name == "cpu"


def test_choosing_cuda_without_a_gpu_is_an_error_naming_it(probes):
    probes.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match=rf"kernel_backend 'cuda' is not available on device {device}: "
                                             r"it needs a CUDA GPU \(torch .* sees none\)"):
            select_backend(device, "cuda")
    with pytest.raises(ValueError, match="kernel_backend 'cuda'.*CUDA GPU"):
        LLM(tiny_llama(), dtype="float32", kernel_backend="cuda")


def test_a_missing_fla_is_named_with_the_pip_extra(probes):
    probes.setattr(torch.cuda, "is_available", lambda: True)          # as if torch saw a GPU
    real_find_spec = importlib.util.find_spec
    probes.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real_find_spec(name, *a))
    assert available_backends("cuda") == ["cpu"]                       # auto falls back
    with pytest.raises(ValueError, match=r"kernel_backend 'cuda' is not available on device cuda: it needs "
                                         r"fla-core .*not installed: pip install 'flashlane\[cuda\]'"):
        select_backend("cuda", "cuda")
    # both pieces missing: both named; a GPU but a cpu engine device: that is named
    probes.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA GPU" in cuda_backend.cuda_missing("cuda") and "fla-core" in cuda_backend.cuda_missing("cuda")
    probes.setattr(torch.cuda, "is_available", lambda: True)
    assert "pass --device cuda" in cuda_backend.cuda_missing("cpu")


def test_a_broken_fla_install_is_named(probes):
    probes.setattr(torch.cuda, "is_available", lambda: True)
    probes.setattr(cuda_backend, "_fla_not_found", lambda: None)
    probes.setitem(sys.modules, "fla", None)                          # its import fails
    assert "a working fla-core" in cuda_backend.cuda_missing("cuda")
    assert available_backends("cuda") == ["cpu"]


def test_with_a_gpu_and_fla_auto_picks_cuda(probes):
    probes.setattr(torch.cuda, "is_available", lambda: True)
    probes.setattr(cuda_backend, "_fla_not_found", lambda: None)
    probes.setattr(cuda_backend, "_fla_import_error", lambda: None)
    assert available_backends("cuda") == ["cuda", "cpu"] and available_backends("cpu") == ["cpu"]
    chosen = select_backend("cuda")
    assert chosen.name == "cuda" and chosen.device == torch.device("cuda")
    assert "chunk_kda prefill, fused_recurrent_kda decode" in chosen.describe()


# ---- fidelity on CPU through Triton's interpreter --------------------------------------------

def _meta(q_lens: list[int], start_lens: list[int], slots: list[int]):
    """The batch metadata the kda op reads (as ForwardBatch.build makes it)."""
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    return SimpleNamespace(q_lens=q_lens, cu_q=cu, ctx_lens_t=torch.tensor([s + q for s, q in zip(start_lens, q_lens)]),
                           state_slots=torch.tensor(slots), is_decode=all(q == 1 for q in q_lens), static=False)


def _inputs(n: int, h: int, dk: int, dv: int, gen: torch.Generator):
    q, k = torch.randn(n, h, dk, generator=gen), torch.randn(n, h, dk, generator=gen)
    v = torch.randn(n, h, dv, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(n, h, dk, generator=gen))    # the lower-bound gate form
    beta = torch.rand(n, h, generator=gen)
    return q, k, v, g, beta


def _compare(meta, h=2, dk=16, dv=8, slots_total=6, seed=0) -> dict:
    """cuda backend vs cpu backend on one kda op: max |diff| of the outputs and of the whole pool."""
    from flashlane.kernels.backends.cpu import CpuBackend

    gen = torch.Generator().manual_seed(seed)
    inputs = _inputs(int(meta.cu_q[-1]), h, dk, dv, gen)
    pool = torch.randn(slots_total, h, dk, dv, generator=gen) * 0.3
    want_pool, got_pool = pool.clone(), pool.clone()
    want = CpuBackend("cpu").kda(*inputs, want_pool, meta)
    got = cuda_backend.CudaBackend("cpu").kda(*inputs, got_pool, meta)
    return {"out": (got - want).abs().max().item(), "pool": (got_pool - want_pool).abs().max().item(),
            "untouched_equal": all(torch.equal(got_pool[s], pool[s]) for s in range(slots_total)
                                   if s not in meta.state_slots.tolist())}


def test_a_static_verify_step_runs_the_plain_torch_steps():
    """A static verify batch (q tokens per sequence, no host lists) never reaches fla's decode or
    the host-list mixed path: the cuda backend steps it as the cpu backend does (no fla needed)."""
    q_len, slots = 3, [2, 5]
    meta = SimpleNamespace(static=True, rows_per_seq=q_len, is_decode=False, q_lens=None,
                           cu_q=torch.arange(len(slots) + 1) * q_len, ctx_lens_t=torch.tensor([7, 12]),
                           state_slots=torch.tensor(slots))
    res = _compare(meta)
    assert res["out"] < 1e-5 and res["pool"] < 1e-5 and res["untouched_equal"], res


def _child() -> dict:
    """Runs in the child process (TRITON_INTERPRET=1): every number the parent test checks."""
    from fla.ops.kda import fused_recurrent_kda

    from flashlane.kernels import kda

    res = {}
    # fla's kernel against our step-by-step reference over several steps, with initial states
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = (x.unflatten(0, (2, 5)) for x in _inputs(10, 2, 16, 8, gen))
    s0 = torch.randn(2, 2, 16, 8, generator=gen) * 0.3
    want_o, want_s = kda.kda_recurrent(q, k, v, g, beta, s0)
    got_o, got_s = fused_recurrent_kda(q, k, v, g, beta, scale=16 ** -0.5, initial_state=s0.clone(),
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    res["recurrent"] = {"out": (got_o - want_o).abs().max().item(), "state": (got_s - want_s).abs().max().item()}
    # decode step through the backend: slot 4 fresh (holding stale numbers), slots 1 and 3 carrying on
    res["decode"] = _compare(_meta([1, 1, 1], [0, 7, 3], [4, 1, 3]))
    # a mixed step: decode (carrying on), prefill fresh, decode fresh, prefill chunk carrying on;
    # the prefill mapping run with fused_recurrent_kda in chunk_kda's place (chunk_kda needs a GPU)
    cuda_backend.CudaBackend.prefill_kernel = staticmethod(fused_recurrent_kda)
    res["mixed"] = _compare(_meta([1, 5, 1, 7], [9, 0, 0, 4], [2, 5, 1, 3]))
    # the decode op traced whole (fullgraph), as a compiled CUDA-graph decode step would trace it
    meta = _meta([1, 1], [0, 3], [2, 1])
    inputs = _inputs(2, 2, 16, 8, torch.Generator().manual_seed(3))
    pool = torch.randn(4, 2, 16, 8, generator=torch.Generator().manual_seed(4))
    eager_pool, traced_pool = pool.clone(), pool.clone()
    backend = cuda_backend.CudaBackend("cpu")
    eager = backend.kda(*inputs, eager_pool, meta)
    traced = torch.compile(lambda *a: backend.kda(*a, meta), fullgraph=True, backend="aot_eager")(*inputs, traced_pool)
    res["traced"] = {"out": (traced - eager).abs().max().item(), "pool_equal": torch.equal(traced_pool, eager_pool)}
    return res


@pytest.mark.skipif(FLA_MISSING is not None, reason=FLA_MISSING or "")
def test_fla_kernels_match_ours_through_the_backend_mapping():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")]))
    code = "import json, test_cuda_backend as t; print('RESULT ' + json.dumps(t._child()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["recurrent"]["out"] < 1e-5 and res["recurrent"]["state"] < 1e-5, res
    for case in ("decode", "mixed"):
        assert res[case]["out"] < 1e-5 and res[case]["pool"] < 1e-5 and res[case]["untouched_equal"], (case, res)
    assert res["traced"]["out"] == 0.0 and res["traced"]["pool_equal"], res


# ---- benchmarks/cuda_check.py, in its CPU mode ----------------------------------------------

def test_cuda_check_script_runs_in_its_dry_run_mode(tmp_path):
    out = tmp_path / "cuda_check.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cuda_check.py"), "--dry-run", "--models", "tiny-llama,tiny-flash",
           "--prefill", "16", "--decode", "1,2", "--decode-context", "8", "--out", str(out)]
    # one thread: tiny ops on a shared machine are many times slower with more (spinning workers)
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["mode"] == "dry-run" and res["ran_on_gpu"] is False and res["errors"] == []
    assert res["machine"]["cpu_capability"] and "cpu_model" in res["machine"]
    assert res["environment"]["test_side"] == "cpu backend on cpu"
    kda_cases, models = res["fidelity"]["kda_op"], res["fidelity"]["models"]
    assert {"mixed_h16_d128", "decode_h16_d128"} <= set(kda_cases) and set(models) == {"tiny-llama", "tiny-flash"}
    # the same kernels on both sides: identical numbers, so every check passes
    assert all(c["ok"] and c["out_rel"] == 0.0 for c in kda_cases.values())
    assert all(m["ok"] and m["greedy_equal"] and max(m["logits_rel"]) == 0.0 for m in models.values()), models
    assert res["ok"] is True
    for section in ("kda_op_h16_d128_bf16", "tiny_flash_forward"):
        cases = res["bench"][section]
        assert set(cases) == {"prefill_16", "decode_1", "decode_2"}, cases
        assert all(set(c["tok_per_s"]) == {"torch", "cpu"} and min(c["tok_per_s"].values()) > 0 for c in cases.values())


def test_cuda_check_without_a_gpu_asks_for_one_or_the_dry_run(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    import cuda_check

    with pytest.raises(SystemExit) as exit_info:
        cuda_check.main(["--out", "unused.json"])
    assert exit_info.value.code == 2 and "--dry-run" in capsys.readouterr().err
