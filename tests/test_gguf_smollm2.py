"""The smollm2-135m preset (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers reading the same file."""

import pytest
import torch
from paged_runner import PagedRunner

from flashlane import presets
from flashlane.models.registry import load_model

try:
    GGUF = presets.smollm2_gguf_path()
except presets.PresetError as exc:  # the package is optional (installed with --no-deps)
    pytest.skip(str(exc), allow_module_level=True)

pytestmark = pytest.mark.slow  # a real 135M model: loading alone takes seconds

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter "
    "and his daughter. Every morning they walked into the forest together, and every evening they came",
]


@pytest.fixture(scope="module")
def ours():
    return load_model("smollm2-135m", dtype="float32")


@pytest.fixture(scope="module")
def hf():
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()


def test_config_and_tokenizer_from_gguf(ours):
    cfg, tok = ours.config, ours.tokenizer
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert tok.eos_token_ids == (2,) and tok.id_to_token(2) == "<|im_end|>"
    text = "Hello, world! 12345 tokens."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert "1" in [tok.id_to_token(i) for i in ids]  # digits are split one by one (smollm pre-tokenizer)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]


def test_weights_equal_transformers_gguf_load(ours, hf):
    mine = ours.model.state_dict()
    ref = hf.state_dict()
    assert set(mine) == set(ref)
    for name, t in ref.items():
        assert torch.equal(mine[name], t), name


def test_prompt_logprobs_match_transformers(ours, hf):
    tok = ours.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    got = PagedRunner(ours.model, ours.config, page_size=16, max_tokens=256, max_seqs=3).prefill(prompts, chunk=24)
    for ids, lp in zip(prompts, got):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        assert (lp - ref).abs().max().item() <= 1e-3


def test_greedy_answers_are_sensible(ours):
    tok = ours.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(prompt, add_special_tokens=False)
    gen = PagedRunner(ours.model, ours.config, max_tokens=256, max_seqs=1).greedy([ids], 24)[0]
    if tok.eos_token_ids[0] in gen:
        gen = gen[:gen.index(tok.eos_token_ids[0])]
    assert "Paris" in tok.decode(gen)
    ids = tok.encode(PROMPTS[0])
    gen = PagedRunner(ours.model, ours.config, max_tokens=128, max_seqs=1).greedy([ids], 4)[0]
    assert "Berlin" in tok.decode(gen)
