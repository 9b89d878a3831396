"""Small models for engine tests: a random tiny llama with a byte tokenizer (always available)
and the presets (tiny-flash, tiny-standard, smollm2-135m) through the registry."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from flashlane.config import parse_config


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


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]
