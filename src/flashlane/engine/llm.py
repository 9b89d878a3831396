"""Offline batch inference, vLLM-style: ``LLM(model, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses

import torch

from .llm_engine import LLMEngine
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .sampling_params import OutputKind, SamplingParams


class LLM:
    def __init__(self, model, **engine_args):
        self.engine = LLMEngine(model, **engine_args)
        self._outputs = OutputProcessor(self.engine.tokenizer)
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Write the prefix cache's disk tier back (if any); the LLM stays usable."""
        self.engine.close()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """``prompts``: a string, a list of strings, a list of token ids, or a list of token-id lists.
        Returns one RequestOutput per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = self._add_all(prompts, params)
        done: dict[str, RequestOutput] = {}
        progress = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                processed = self._outputs.process(delta)
                if processed.stopped:
                    self.engine.abort(delta.request_id, "stop")
                out = processed.output
                if out is not None and out.finished:
                    done[out.request_id] = out
                    if progress:
                        progress[0].advance(progress[1])
        if progress:
            progress[0].stop()
        return [done[r] for r in ids]

    def _add_all(self, prompts: list, params: list[SamplingParams]) -> list[str]:
        """Queue every prompt (each one's outputs accumulated in full), or none of them."""
        ids = []
        for prompt, p in zip(prompts, params):
            rid = f"gen-{self._counter}"
            self._counter += 1
            p = dataclasses.replace(p, output_kind=OutputKind.FINAL_ONLY)
            try:
                req = self.engine.add_request(rid, prompt, p)
            except ValueError:  # e.g. too long for the context: none of this batch stays queued
                for added in ids:
                    self.engine.abort(added)
                    self._outputs.remove(added)
                raise
            self._outputs.add(rid, req.prompt_token_ids, p, req.metrics.arrival_time,
                              prompt if isinstance(prompt, str) else None)
            ids.append(rid)
        return ids

    def score(self, token_id_windows: list[list[int]]) -> list[torch.Tensor]:
        """Full next-token log-probs through the serving path (paged cache, chunked prefill, the
        engine's quantisation and cache dtype): per window a float32 tensor [len - 1, vocab] whose
        row i is the distribution of token i + 1 given tokens 0..i. Every position is computed:
        a request asking for prompt logprobs reads nothing from the prefix cache (its pages are
        still cached for later requests). Each window costs (len - 1) x vocab x 4 bytes: pass a
        few at a time."""
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
        reqs = []
        for window in token_id_windows:
            if len(window) < 2:
                raise ValueError(f"a scored window needs at least 2 tokens, got {len(window)}")
            req = self.engine.add_request(f"score-{self._counter}", list(window), params,
                                          keep_prompt_logprob_rows=True)
            self._counter += 1
            reqs.append(req)
        while self.engine.has_unfinished():
            self.engine.step()
        out = []
        for req in reqs:
            rows = torch.cat(req.prompt_logprob_rows) if req.prompt_logprob_rows else torch.empty(0)
            if rows.shape[0] != req.num_prompt_tokens - 1:   # the engine skipped positions: a bug, not bad input
                raise RuntimeError(f"{req.request_id}: {rows.shape[0]} of {req.num_prompt_tokens - 1} positions "
                                   "were scored")
            out.append(rows)
        return out


def _progress(total: int):
    from rich.progress import Progress
    bar = Progress()
    task = bar.add_task("generating", total=total)
    bar.start()
    return bar, task
