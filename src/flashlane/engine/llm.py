"""Offline batch inference, vLLM-style: ``LLM(model, **engine_args).generate(prompts, params)``."""

from __future__ import annotations

from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model, **engine_args):
        self.engine = LLMEngine(model, **engine_args)
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
        ids = []
        for prompt, p in zip(prompts, params):
            rid = f"gen-{self._counter}"
            self._counter += 1
            try:
                self.engine.add_request(rid, prompt, p)
            except ValueError:  # e.g. too long for the context: none of this batch stays queued
                for added in ids:
                    self.engine.abort(added)
                raise
            ids.append(rid)
        done: dict[str, RequestOutput] = {}
        progress = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if progress:
                        progress[0].advance(progress[1])
        if progress:
            progress[0].stop()
        return [done[r] for r in ids]


def _progress(total: int):
    from rich.progress import Progress
    bar = Progress()
    task = bar.add_task("generating", total=total)
    bar.start()
    return bar, task
