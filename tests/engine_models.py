"""Small models for engine tests: a random tiny llama and small random GLM models with a byte
tokenizer (always available), and the presets (tiny-flash, tiny-standard, smollm2-135m) through the registry."""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import torch

from flashlane.config import parse_config
from hf_tiny import GLM5_NEXT_TINY_TEXT, GLM_MOE_DSA_TINY


class ByteTokenizer:
    eos_token_ids = (2,)
    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i > 2).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=None)
def tiny_llama(seed: int = 0):
    from flashlane.models.llama import LlamaForCausalLM

    cfg = parse_config(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=4096, eos_token_id=2))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return SimpleNamespace(model=model.eval(), config=cfg, tokenizer=ByteTokenizer(), name="tiny-llama", path=None)


@functools.lru_cache(maxsize=None)
def preset(name: str):
    from flashlane.models.registry import load_model

    return load_model(name, dtype="float32")


def bf16_copy(m):
    """A copy of a loaded model in bf16 (the engine keeps a given model's dtype)."""
    m = copy.deepcopy(m)
    m.model.to(torch.bfloat16)
    return m


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def small_glm(arch: str, seed: int = 0, mtp: bool | None = None, **text_overrides):
    """A two-to-three layer random model of ``arch`` (every mixer and FFN kind it has); ``mtp``:
    with its MTP layer (None: glm_moe_dsa with, glm5_next without); ``text_overrides``: glm5_next
    config fields (index_kpool, hc_mult, ...)."""
    if arch == "glm5_next":
        from flashlane.models.glm5_next import Glm5NextForCausalLM as cls
        text = dict(GLM5_NEXT_TINY_TEXT, num_hidden_layers=3, vocab_size=256,
                    layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
                    indexer_types=["full", "full", "shared"], mlp_layer_types=["dense", "sparse", "sparse"])
        text.update(text_overrides)
        raw = dict(model_type="glm5_next", text_config=dict(text, model_type="glm5_next_text"))
    else:
        from flashlane.models.glm_moe_dsa import GlmMoeDsaForCausalLM as cls
        raw = dict(GLM_MOE_DSA_TINY, model_type="glm_moe_dsa", num_hidden_layers=3, vocab_size=256,
                   indexer_types=["full", "shared", "full"])
    cfg = parse_config(raw)
    torch.manual_seed(seed)
    model = cls(cfg, with_mtp=(arch != "glm5_next") if mtp is None else mtp)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return SimpleNamespace(model=model.eval(), config=cfg, tokenizer=ByteTokenizer(), name=f"small-{arch}",
                           path=None)


# A different cut of the same tokens into prefill chunks (a preempted request recomputes what it
# had decoded; another token budget splits a prompt elsewhere) changes float32 rounding by ~1e-7.
# DSA's top-k selection turns that into another selected set where index scores tie (ReLU zeros
# tie exactly), which moves logits by ~1e-2; the random tiny presets' logits are nearly uniform,
# so such a move can flip a greedy choice whose lead is that small.
NEAR_TIE = 0.05


def assert_greedy_equal_up_to_near_ties(want, got, tie: float = NEAR_TIE) -> int:
    """Greedy outputs (requested with ``logprobs`` >= 2) equal token for token, except that a
    request may diverge at a position where ``want``'s two best logprobs were within ``tie``; up
    to there the chosen tokens' logprobs must agree within ``tie``. Returns how many diverged."""
    diverged = 0
    for r, (a, b) in enumerate(zip(want, got, strict=True)):
        i = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        for j, t in enumerate(a.token_ids[:i]):
            assert abs(a.logprobs[j][t] - b.logprobs[j][t]) < tie, f"request {r}, token {j}: logprobs drifted"
        if i is None:
            assert len(a.token_ids) == len(b.token_ids), f"request {r}: {len(a.token_ids)} != {len(b.token_ids)} tokens"
            continue
        top = sorted(a.logprobs[i].values(), reverse=True)
        assert top[0] - top[1] < tie, (f"request {r} diverged at token {i}, where the greedy choice led by "
                                       f"{top[0] - top[1]:.3g} (not a near-tie)")
        diverged += 1
    return diverged
