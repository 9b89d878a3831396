"""One evaluation: an fp32 uncompressed reference run of the model, then each configuration on
the same engine path, compared window by window so no window's logits outlive its step."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, fields
from typing import Callable

import torch

from .. import presets
from ..engine.engine_args import EngineArgs
from ..engine.llm import LLM
from ..engine.sampling_params import SamplingParams
from ..machine import machine_info
from .corpus import make_windows
from ..models.quantize import weight_bytes
from .measure import cache_bytes, throughput
from .metrics import Agreement, Likelihood, greedy_agreement
from .sweep import MODEL_KEY, Configuration, check_options

# the options a reference run resets to their engine defaults (no compression, the config's
# sparsity); dtype is pinned to float32. Only those this engine has are touched.
COMPRESSION_OPTIONS = ("quantization", "kv_cache_dtype", "index_topk")
# every scored position must be computed, and speed must not profit from reuse across runs
NO_REUSE = {"enable_prefix_caching": False, "host_cache_memory": 0, "disk_cache_dir": None, "disk_cache_bytes": None}

METHOD = ("perplexity: the corpus tokenised whole (no special tokens), cut into consecutive "
          "non-overlapping windows of {window} tokens (at most {max_windows}); tokens 2..{window} of each "
          "window scored given the tokens before them in that window; exp(mean NLL over all scored tokens). "
          "top-1 agreement / KL(ref||cand): the same positions, against the reference run's distributions. "
          "greedy agreement: {greedy_prompts} prompts of {greedy_prompt_len} corpus tokens, {greedy_tokens} "
          "greedy tokens each; 'prefix' = matching tokens up to the first divergence, 'positionwise' = "
          "matching positions, as fractions of {greedy_tokens}, averaged over prompts.")


@dataclass
class EvalSettings:
    window: int = 512
    max_windows: int | None = 8
    greedy_prompts: int = 8
    greedy_prompt_len: int = 64
    greedy_tokens: int = 32
    decode_tokens: int = 32
    decode_batches: tuple[int, ...] = (1, 16)
    measure_speed: bool = True
    reference_cache_bytes: int = 1 << 30   # reference log-probs kept in memory; beyond, recomputed


def reference_options(base: dict) -> dict:
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    return {**base, "dtype": "float32", **{k: defaults[k] for k in COMPRESSION_OPTIONS if k in defaults}}


def is_random_preset(model: str) -> bool:
    preset = presets.PRESETS.get(str(model))
    return preset is not None and preset.kind == "random"


def _load(model: str, kwargs: dict) -> LLM:
    llm = LLM(model, **{**kwargs, **NO_REUSE})
    if llm.tokenizer is None:
        raise ValueError(f"eval needs the model's tokenizer to read the corpus; {model} has none")
    return llm


class _Reference:
    """The reference run's log-probs per window: kept while they fit the budget, else recomputed."""

    def __init__(self, llm: LLM, windows: list[list[int]], budget: int):
        self.llm, self.windows, self.kept = llm, windows, {}
        row_bytes = llm.engine.config.vocab_size * 4
        self.keep_all = sum((len(w) - 1) * row_bytes for w in windows) <= budget
        self.budget = budget

    def logprobs(self, i: int) -> torch.Tensor:
        if i in self.kept:
            return self.kept[i]
        lp = self.llm.score([self.windows[i]])[0]
        if sum(t.numel() * 4 for t in self.kept.values()) + lp.numel() * 4 <= self.budget:
            self.kept[i] = lp
        return lp


def evaluate(model: str, base_kwargs: dict, configurations: list[Configuration], corpus: tuple[str, str],
             settings: EvalSettings | None = None,
             on_done: Callable[[str], None] | None = None) -> dict:
    """Run the reference and every configuration; returns the whole result (JSON-ready)."""
    s = settings or EvalSettings()
    ref_kwargs = reference_options(base_kwargs)
    checked = [(c, check_options(base_kwargs, c.options)) for c in configurations]
    ref_llm = _load(model, ref_kwargs)
    tokenizer = ref_llm.tokenizer
    corpus_name, text = corpus
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    windows = make_windows(token_ids, s.window, s.max_windows)
    prompts = [token_ids[i * s.window: i * s.window + s.greedy_prompt_len] for i in range(s.greedy_prompts)
               if i * s.window + s.greedy_prompt_len <= len(token_ids)]

    reference = _Reference(ref_llm, windows, s.reference_cache_bytes)
    likelihood = Likelihood()
    for i, w in enumerate(windows):
        lp = reference.logprobs(i)
        likelihood.add(lp, torch.tensor(w[1:]))
        del lp
    ref_greedy = _greedy(ref_llm, prompts, s.greedy_tokens)
    ref_row = {"label": "reference (float32, uncompressed)", "model": str(model), "options": {},
               "random_weights": is_random_preset(model), **likelihood.summary(),
               "top1_agreement": 1.0, "kl_mean": 0.0, "kl_p99": 0.0, "kl_max": 0.0,
               "greedy_prefix_agreement": 1.0, "greedy_positionwise_agreement": 1.0,
               **_cost(ref_llm, windows[0], s)}
    if reference.keep_all:   # its log-probs are all kept: free the model before the candidates load
        reference.llm = None
        del ref_llm
        gc.collect()
    if on_done:
        on_done(ref_row["label"])

    rows = []
    for config, kwargs in checked:
        cand_model = config.options.get(MODEL_KEY, model)
        if kwargs == ref_kwargs and str(cand_model) == str(model):
            rows.append({**ref_row, "label": config.label, "options": config.options, "same_as_reference": True})
            if on_done:
                on_done(config.label)
            continue
        rows.append(_candidate(config, cand_model, kwargs, reference, windows, prompts, ref_greedy, ref_row,
                               tokenizer, s))
        gc.collect()
        if on_done:
            on_done(config.label)
    return {
        "model": str(model), "method": METHOD.format(**vars(s)), "settings": {**vars(s)},
        "corpus": {"name": corpus_name, "characters": len(text), "tokens": len(token_ids),
                   "windows": len(windows), "window": s.window},
        "machine": machine_info(), "base_options": base_kwargs, "reference_options": ref_kwargs,
        "reference": ref_row, "configurations": rows, "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _candidate(config, cand_model, kwargs, reference, windows, prompts, ref_greedy, ref_row, tokenizer, s) -> dict:
    llm = _load(cand_model, kwargs)
    sample = "The quick brown fox, 12345 tokens; def f(x): return x"
    if llm.tokenizer.encode(sample) != tokenizer.encode(sample):
        raise ValueError(f"model {cand_model}: its tokenizer differs from {ref_row['model']}'s; "
                         "a candidate must share the reference's tokenizer")
    agreement, likelihood = Agreement(), Likelihood()
    for i, w in enumerate(windows):
        lp = llm.score([w])[0]
        likelihood.add(lp, torch.tensor(w[1:]))
        agreement.add(reference.logprobs(i), lp)
        del lp
    greedy = (greedy_agreement(ref_greedy, _greedy(llm, prompts, s.greedy_tokens)) if ref_greedy
              else {"prefix": None, "positionwise": None})
    row = {"label": config.label, "model": str(cand_model), "options": config.options,
           "random_weights": is_random_preset(cand_model), **likelihood.summary(), **agreement.summary(),
           "greedy_prefix_agreement": greedy["prefix"], "greedy_positionwise_agreement": greedy["positionwise"],
           **_cost(llm, windows[0], s)}
    row["perplexity_ratio"] = row["perplexity"] / ref_row["perplexity"]
    llm.close()
    return row


def _greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    if not prompts:
        return []
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def _cost(llm: LLM, prompt_ids: list[int], s: EvalSettings) -> dict:
    engine = llm.engine
    info = {"weight_bytes": weight_bytes(engine.model), **cache_bytes(engine.startup),
            "engine": {k: engine.startup.get(k) for k in ("dtype", "kv_cache_dtype", "index_topk")
                       if k in engine.startup}}
    if s.measure_speed:
        info.update(throughput(llm, prompt_ids, s.decode_tokens, s.decode_batches))
    return info
