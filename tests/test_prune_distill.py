"""`flashlane prune` / `flashlane distill`: pruned and distilled checkpoints load in flashlane and in
transformers with the same logits; the kept counts are exact; routing decides which experts stay;
bad keep values fail before anything is written; distillation lowers the KL on a fixed batch."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from flashlane.cli.main import main
from flashlane.cli.make_tiny import make_tiny
from flashlane.compress.calibration import corpus_windows, forward_logits, tail_windows
from flashlane.compress.checkpoint import write_checkpoint
from flashlane.compress.distill import (
    DistillSettings,
    distill,
    kd_loss,
    training_windows,
)
from flashlane.compress.prune import plan_pruning, prune_model
from flashlane.compress.prune_experts import ExpertCollector, select_experts
from flashlane.compress.student import load_trainable, save_student, student_folder
from flashlane.models.loader import read_tensors, save_checkpoint
from flashlane.models.registry import load_model

TOL = 1e-4
SEQ = 32
TEXT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


def _max_logprob_err(folder, ids) -> float:
    ours = load_model(folder, dtype="float32")
    got = forward_logits(ours.model, ours.config, [ids])[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    return float((got.log_softmax(-1) - want.log_softmax(-1)).abs().max())


def _prune(model_id, out, experts=None, mlp=None, windows=4, edit=None):
    loaded = load_model(model_id, dtype="float32")
    if edit is not None:
        edit(loaded.model)
    plan = plan_pruning(loaded.model, loaded.config, experts, mlp)
    state, config = prune_model(loaded.model, loaded.config, plan,
                                corpus_windows(loaded.tokenizer, None, SEQ, windows))
    write_checkpoint(out, state, config, source=loaded.path, tokenizer=loaded.tokenizer)
    return loaded, state, config


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """make-tiny's llama with its matrices x5: peaked next-token distributions, a KL worth lowering."""
    folder = make_tiny("llama", tmp_path_factory.mktemp("llama") / "teacher")
    save_checkpoint(folder, {n: t * 5 if t.dim() == 2 else t for n, t in read_tensors(folder).items()})
    return folder


@pytest.fixture(scope="module")
def standard_skeleton():
    return load_model("tiny-standard", dtype="float32", load_format="dummy")


@pytest.fixture(scope="module")
def pruned_llama(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("pruned") / "half"
    _prune(tiny_llama, out, mlp=0.5)
    return out


def test_llama_channel_pruning_keeps_the_requested_width_and_matches_transformers(tiny_llama, pruned_llama):
    config = json.loads((pruned_llama / "config.json").read_text())
    assert config["intermediate_size"] == 192   # 0.5 x 384, every layer
    pruned = load_model(pruned_llama, dtype="float32")
    for layer in pruned.model.model.layers:
        assert layer.mlp.down_proj.weight.shape == (128, 192)
    ids = pruned.tokenizer.encode(TEXT, add_special_tokens=False)
    assert _max_logprob_err(pruned_llama, ids) <= TOL
    assert transformers.AutoTokenizer.from_pretrained(str(pruned_llama))(TEXT, add_special_tokens=False)["input_ids"] == ids


def test_channel_pruning_keeps_the_channels_of_highest_activation_weighted_magnitude(tiny_llama, pruned_llama):
    teacher = load_model(tiny_llama, dtype="float32")
    pruned = load_model(pruned_llama, dtype="float32")
    mlp = teacher.model.model.layers[1].mlp
    acts = []
    hook = mlp.down_proj.register_forward_pre_hook(lambda m, a: acts.append(a[0].abs()))
    windows = corpus_windows(teacher.tokenizer, None, SEQ, 4)
    for w in windows:
        forward_logits(teacher.model, teacher.config, [w])
    hook.remove()
    score = torch.cat(acts).mean(0) * mlp.down_proj.weight.norm(dim=0)
    kept = score.topk(192).indices.sort().values
    assert torch.equal(pruned.model.model.layers[1].mlp.down_proj.weight, mlp.down_proj.weight[:, kept])
    assert torch.equal(pruned.model.model.layers[1].mlp.gate_proj.weight, mlp.gate_proj.weight[kept])


def test_expert_pruning_drops_experts_the_router_never_picks_and_matches_transformers(tmp_path):
    never = [0, 5, 9, 13]

    def shun(model):  # a large negative correction bias: these experts never make anyone's top-2
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias[never] = -100.0

    out = tmp_path / "experts"
    loaded, state, config = _prune("tiny-standard", out, experts="12", mlp=0.5, windows=2, edit=shun)
    assert config["n_routed_experts"] == 12 and config["moe_intermediate_size"] == 64
    assert config["intermediate_size"] == 384 and config["num_nextn_predict_layers"] == 0
    src = loaded.model.model.layers[3].mlp
    kept = [e for e in range(16) if e not in never]
    got = state["model.layers.3.mlp.gate.weight"]
    assert torch.equal(got, src.gate.weight[kept])
    assert torch.equal(state["model.layers.3.mlp.gate.e_score_correction_bias"], src.gate.e_score_correction_bias[kept])
    assert state["model.layers.3.mlp.experts.gate_up_proj"].shape == (12, 128, 384)
    assert state["model.layers.3.mlp.shared_experts.down_proj.weight"].shape == (384, 64)
    ids = load_model(out, dtype="float32").tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) < 64    # below index_topk: both sides attend to every token
    assert _max_logprob_err(out, ids) <= TOL


def test_expert_saliency_is_gate_weight_times_output_norm_over_routed_tokens():
    loaded = load_model("tiny-standard", dtype="float32")
    collector = ExpertCollector()
    handles = collector.attach(loaded.model)
    moe = loaded.model.model.layers[2].mlp
    seen = []
    handles.append(moe.register_forward_hook(lambda m, a, o: seen.append(a[0])))
    forward_logits(loaded.model, loaded.config, tail_windows(list(range(100, 140)), 20, 2))
    for h in handles:
        h.remove()
    x = torch.cat(seen)
    weights, ids = moe.gate(x)
    e = int(ids[0, 0])
    rows, slot = (ids == e).nonzero(as_tuple=True)
    gate, up = torch.nn.functional.linear(x[rows], moe.experts.gate_up_proj[e]).chunk(2, -1)
    out = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, moe.experts.down_proj[e])
    want = (weights[rows, slot] * out.norm(dim=-1)).mean()
    stats = collector.stats["model.layers.2.mlp"]
    assert stats.tokens.sum() == 2 * 20 * loaded.config.num_experts_per_tok
    assert torch.allclose(stats.saliency()[e], want, rtol=1e-5)


def test_select_experts_keeps_the_same_number_in_every_group():
    saliency = torch.tensor([5.0, 1.0, 3.0, 0.0, 2.0, 9.0, 8.0, 7.0])
    assert select_experts(saliency, 4).tolist() == [0, 5, 6, 7]
    assert select_experts(saliency, 4, n_group=2).tolist() == [0, 2, 5, 6]


@pytest.mark.parametrize("flags, flag", [
    (["--mlp-keep", "0.001"], "--mlp-keep"),
    (["--mlp-keep", "1.5"], "--mlp-keep"),
    (["--experts-keep", "4"], "--experts-keep"),          # llama has no experts
])
def test_prune_refuses_a_keep_value_before_writing_anything(tiny_llama, tmp_path, capsys, flags, flag):
    out = tmp_path / "out"
    assert main(["prune", str(tiny_llama), "--out", str(out), *flags]) == 2
    assert f"flashlane prune: error: {flag}" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("keep", ["0", "0.01", "1", "17"])
def test_expert_keep_that_leaves_no_expert_or_too_few_is_an_error(standard_skeleton, keep):
    with pytest.raises(ValueError, match="--experts-keep"):
        plan_pruning(standard_skeleton.model, standard_skeleton.config, keep, None)


def test_expert_keep_fraction_and_count_agree(standard_skeleton):
    assert plan_pruning(standard_skeleton.model, standard_skeleton.config, "0.5", None).experts == 8
    assert plan_pruning(standard_skeleton.model, standard_skeleton.config, "8", 0.25).expert_channels == 32


def test_distillation_lowers_the_kl_on_a_fixed_batch_and_writes_a_loadable_checkpoint(tiny_llama, pruned_llama,
                                                                                        tmp_path):
    teacher = load_model(tiny_llama, dtype="float32")
    student = student_folder(str(pruned_llama))
    ids = teacher.tokenizer.encode(TEXT * 40, add_special_tokens=False)
    settings = DistillSettings(steps=5, temperature=1.0, lr=1e-3, seq_len=SEQ, batch_size=2)
    trainable = load_trainable(student.path)
    result = distill(teacher.model, teacher.config, trainable, training_windows(ids, settings), settings)
    assert len(result.losses) == 5
    assert result.probe_after < result.probe_before
    out = save_student(trainable, student, tmp_path / "distilled")
    again = load_model(out, dtype="float32")
    probe = ids[:SEQ]
    with torch.no_grad():
        want = trainable(input_ids=torch.tensor([probe])).logits[0]
    got = forward_logits(again.model, again.config, [probe])[0]
    assert float((got.log_softmax(-1) - want.log_softmax(-1)).abs().max()) <= TOL
    assert _max_logprob_err(out, probe) <= TOL


@pytest.mark.parametrize("bad", [{"steps": 0}, {"seq_len": 1}, {"batch_size": 0}, {"temperature": 0.0},
                                 {"temperature": float("nan")}, {"lr": -1e-4}])
def test_distill_settings_refuse_bad_values_naming_the_flag(bad):
    flag = "--" + next(iter(bad)).replace("_", "-")
    with pytest.raises(ValueError, match=flag):
        DistillSettings(**bad).check()


def test_kd_loss_is_temperature_squared_kl():
    s, t = torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[2.0, 0.0, 1.0]])
    p, q = (t / 2).softmax(-1), (s / 2).softmax(-1)
    assert torch.allclose(kd_loss(s, t, 2.0), 4 * (p * (p / q).log()).sum())


def test_prune_command_writes_a_folder_that_analyze_counts(tiny_llama, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["prune", str(tiny_llama), "--out", str(out), "--mlp-keep", "0.25",
                 "--calibration-tokens", "64", "--seq-len", "32"]) == 0
    capsys.readouterr()
    tensors = read_tensors(out)
    assert main(["analyze", str(out), "--json"]) == 0
    params = json.loads(capsys.readouterr().out)["models"][0]["params"]
    assert params["total"] == sum(t.numel() for t in tensors.values())
    assert params["by_component"]["dense_ffn"]["total"] == 4 * 3 * 128 * 96
