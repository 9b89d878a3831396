"""The engine seam: model classes declare their abilities through typing protocols, and what
the engine knows about itself is one frozen EngineInfo."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from flashlane.engine.llm_engine import LLMEngine
from flashlane.models.loader import FP32_PARAMS
from flashlane.models.protocol import CausalLM, Compilable, OptionalMtp, PostLoad, fp32_param_names
from flashlane.models.registry import model_class

from engine_models import tiny_llama


def test_model_classes_declare_their_abilities():
    flash, standard, llama = (model_class(a) for a in ("glm5_next", "glm_moe_dsa", "llama"))
    assert all(issubclass(c, CausalLM) and issubclass(c, PostLoad) for c in (flash, standard, llama))
    assert issubclass(flash, OptionalMtp) and issubclass(standard, OptionalMtp) and not issubclass(llama, OptionalMtp)
    assert issubclass(flash, Compilable) and not issubclass(llama, Compilable)
    assert fp32_param_names(flash, FP32_PARAMS) == flash.keep_fp32_params
    assert fp32_param_names(llama, FP32_PARAMS) == FP32_PARAMS


def test_the_engine_refuses_a_module_that_is_not_a_causal_lm():
    loaded = SimpleNamespace(model=torch.nn.Linear(2, 2), config=None, tokenizer=None, name="x", path=None)
    with pytest.raises(TypeError, match="not a CausalLM"):
        LLMEngine(loaded, dtype="float32")


def test_engine_info_is_frozen_and_the_startup_report_keeps_its_keys():
    engine = LLMEngine(tiny_llama(), dtype="float32", cache_memory=8 << 20)
    info = engine.info
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.max_model_len = 1
    report = engine.startup
    assert "vocab_size" not in report and "quantization_summary" not in report
    assert report["max_running"] == info.max_running and report["num_tokens"] == info.num_tokens
    assert info.vocab_size == engine.config.vocab_size and info.max_model_len == engine.max_model_len
    assert engine.describe_cache() == info.describe_cache() and info.describe_weights().endswith("no quantization")
