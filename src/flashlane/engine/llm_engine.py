"""The synchronous engine: add requests, call ``step()``; the offline LLM and the async server
engine both drive it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

import torch

from ..cache_spec import cache_spec, chunk_multiple
from ..models.dsa_attention import check_index_topk
from ..models.loader import auto_cpu_dtype_choice
from ..models.protocol import CausalLM, Compilable
from ..models.quantize import Int8Embedding, quantize, weight_bytes
from .cache.fingerprint import weights_fingerprint
from .cache.manager import CacheManager, plan_cache
from .compiled_decode import CompiledDecode, cuda_graph_mode
from .engine_args import EngineArgs
from .info import EngineInfo
from .outputs import RequestOutput
from .request import Request, Status
from .runner import ModelRunner
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .static_scheduler import StaticScheduler
from .step_log import StepLog, StepRecord
from .stop_checker import StopChecker
from .structured_output import Grammars

log = logging.getLogger("flashlane.engine")


def _model_dtype(model) -> torch.dtype:
    """The model's float dtype: its token embedding's (an int8 table remembers the float one)."""
    emb = next(m for m in model.modules() if isinstance(m, (torch.nn.Embedding, Int8Embedding)))
    return emb.float_dtype if isinstance(emb, Int8Embedding) else emb.weight.dtype


class LLMEngine:
    def __init__(self, model, **engine_args):
        args = EngineArgs.from_kwargs(**engine_args)
        args.validate()
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        loaded_here = isinstance(model, str)
        if loaded_here:
            from ..models.registry import load_model
            model = load_model(model, dtype=args.dtype, seed=args.seed, device=args.device,
                               require_tokenizer=not args.skip_tokenizer_init)
        self.loaded = model
        if not isinstance(model.model, CausalLM):
            raise TypeError(f"{type(model.model).__name__} is not a CausalLM (forward(batch), compute_logits(hidden))")
        self.model: CausalLM = model.model
        self.dtype = _model_dtype(self.model)
        self.quant = quantize(self.model, args.quantization, device=args.device) if args.quantization else None
        if isinstance(self.model, Compilable):
            self.model.set_compile(args.compile)
        self.config = model.config
        if args.index_topk is not None:
            check_index_topk(self.config, args.index_topk)
        has_indexer = bool(self.config.full_indexer_layers)
        index_topk = (args.index_topk or self.config.index_topk) if has_indexer else None
        self.tokenizer = None if args.skip_tokenizer_init else model.tokenizer  # None: token ids only
        self.model_name = model.name
        spec = cache_spec(self.config, args.page_size, args.kv_cache_dtype)
        plan = plan_cache(spec, self.dtype, args.cache_memory, args.max_num_seqs,
                          args.num_pages, args.num_slots, args.device,
                          checkpoint_share=args.checkpoint_share if args.enable_prefix_caching else 0.0,
                          num_checkpoints=args.num_checkpoints if args.enable_prefix_caching else 0)
        fingerprint = f"{self.model_name}|{self.config.arch}|{self._dtype_name()}|index_topk={index_topk}"
        if args.disk_cache_dir:
            fingerprint += "|" + weights_fingerprint(self.model)
        try:
            self.cache = CacheManager(spec, plan, self.dtype, args.device, args.enable_prefix_caching, fingerprint,
                                      args.host_cache_memory, args.disk_cache_dir, args.disk_cache_bytes,
                                      args.disk_load_timeout_s)
        except OSError as e:
            raise ValueError(f"disk_cache_dir {args.disk_cache_dir!r} is not a writable directory: {e}") from e
        self.max_model_len = min(args.max_model_len or self.config.max_position_embeddings, plan.num_tokens)
        max_running = min(args.max_num_seqs, plan.num_slots if spec.needs_state_slot else args.max_num_seqs,
                          plan.num_pages)
        granularity = chunk_multiple(self.config, args.page_size)
        if args.scheduler == "static":
            self.scheduler = StaticScheduler(self.cache, max_running, args.max_num_batched_tokens, granularity,
                                             args.static_batch_size)
        else:
            self.scheduler = Scheduler(self.cache, max_running, args.max_num_batched_tokens, granularity,
                                       args.max_wait_ms)
        compiled = None
        if args.compile:
            topk = index_topk or 0
            compiled = CompiledDecode(self.model, self.cache.tensors,
                                      [b for b in args.compile_sizes if b < max_running] + [min(
                                          max_running, args.compile_sizes[-1])],
                                      args.index_topk, min_width=-(-topk // spec.page_size),
                                      mode=cuda_graph_mode(args.device))
        self.grammars = Grammars(self.tokenizer, self.config.vocab_size, self.config.eos_token_ids)
        self.runner = ModelRunner(self.model, self.cache, args.seed, args.index_topk, compiled, self.grammars)
        self.requests: dict[str, Request] = {}
        self.stop_checker = StopChecker(self.tokenizer, self.max_model_len)
        self.step_stats = StepLog(args.step_log_size)
        self._num_steps = 0
        self.counters: Counter = Counter()
        self.finish_reasons: Counter = Counter()
        dtype_name = self._dtype_name()
        self.info = EngineInfo(
            model=self.model_name, arch=self.config.arch, dtype=str(self.dtype).replace("torch.", ""),
            vocab_size=self.config.vocab_size, max_model_len=self.max_model_len, max_running=max_running,
            page_size=spec.page_size, num_pages=plan.num_pages, num_tokens=plan.num_tokens,
            num_state_slots=plan.num_slots, bytes_per_page=plan.bytes_per_page,
            bytes_per_slot=plan.bytes_per_slot, cache_bytes=self.cache.tensors.nbytes(),
            latent_bytes_per_token=spec.latent_bytes_per_token(dtype_name),
            index_bytes_per_token=spec.index_bytes_per_token(dtype_name),
            kv_cache_dtype=spec.kv_dtype_name(dtype_name),
            pool_bytes_per_token=spec.page_bytes_per_token(dtype_name),
            index_topk=index_topk, config_index_topk=self.config.index_topk if has_indexer else None,
            prefix_caching=args.enable_prefix_caching, num_checkpoints=plan.num_checkpoints,
            bytes_per_checkpoint=plan.bytes_per_slot if plan.num_checkpoints else 0,
            host_cache_bytes=args.host_cache_memory if args.enable_prefix_caching else 0,
            disk_cache_dir=args.disk_cache_dir, disk_cache_bytes=args.disk_cache_bytes,
            scheduler=args.scheduler,
            static_batch_size=args.static_batch_size if args.scheduler == "static" else None,
            weight_bytes=weight_bytes(self.model), quantization=self._quant_report(),
            quantization_summary="no quantization" if self.quant is None else self.quant.describe(),
            dtype_reason=(auto_cpu_dtype_choice().why if args.dtype == "auto" and loaded_here
                          and torch.device(args.device).type == "cpu" else None),
        )
        log.info(self.describe_weights())
        log.info(self.describe_cache())
        if compiled is not None:
            w = compiled.warm_up()
            self.info = dataclasses.replace(self.info, compiled_decode={
                "sizes": list(w.sizes), "warmup_s": round(w.seconds, 2), "cache_dir": w.cache_dir})
            log.info(self.info.describe_compile())
        if args.compile:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile before serving: torch.compile specialises one token vs many on first use, and
        that pause (seconds) must not land inside a client's request."""
        for i, (n, out) in enumerate(((8, 2), (3, 4))):    # steps of 11, 2 and 1 tokens
            self.add_request(f"__warmup{i}", list(range(1, n + 1)),
                             SamplingParams(max_tokens=out, temperature=0, ignore_eos=True))
        while self.has_unfinished():
            self.step()
        self.step_stats.clear()
        self._num_steps = 0
        self.counters.clear()
        self.finish_reasons.clear()
        self.scheduler.num_preemptions = 0
        for k in self.cache.counters:
            self.cache.counters[k] = 0

    def close(self) -> None:
        """Release what outlives requests: the cache tiers write back to disk (bounded in time, best
        effort: a disk fault is logged and counted, never raised) and stop loading."""
        self.cache.close()

    def _quant_report(self) -> dict | None:
        q = self.quant
        if q is None:
            return None
        return {"method": q.method, "linears": q.linears, "experts": q.experts, "expert_layers": q.expert_layers,
                "head": q.head, "embeddings": q.embeddings, "bytes_before": q.bytes_before, "bytes_after": q.bytes_after,
                "kernels": q.plan.by_class(), "why": q.plan.why}

    @property
    def startup(self) -> dict:
        """The start-up report as a dict (``EngineInfo.report()``), for callers that index it."""
        return self.info.report()

    def describe_weights(self) -> str:
        return self.info.describe_weights()

    def describe_cache(self) -> str:
        return self.info.describe_cache()

    def _dtype_name(self) -> str:
        return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.dtype]

    # ---- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True, or a checkpoint "
                                 "without tokenizer.json): give prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and 0 <= t < self.config.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self.config.vocab_size})")
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> Request:
        params = params or SamplingParams()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (this engine has none): use stop_token_ids")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the maximum context is {self.max_model_len} "
                             f"(pool: {self.cache.plan.num_tokens} tokens)")
        fits = self.max_model_len - len(ids)
        max_tokens = fits if params.max_tokens is None else params.max_tokens  # None: the rest of the context
        if max_tokens > fits:  # refused, not clamped (OpenAI, vLLM); the caller's params stay as given
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                             f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
                             f"in the completion). Lower max_tokens to at most {fits}, or pass max_tokens=None "
                             "for the rest of the context.")
        grammar = self.grammars.matcher(params.structured) if params.structured is not None else None
        req = Request(request_id, ids, params, self.config.eos_token_ids, arrival_time)
        req.max_tokens = max_tokens
        req.grammar = grammar
        if isinstance(prompt, str):
            req.prompt = prompt
        self.requests[request_id] = req
        self.stop_checker.add(req)
        self.scheduler.add(req)
        self.counters["requests_added"] += 1
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.scheduler.remove(req)
        return self._finish(req, "abort", time.monotonic())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        wall_start, start = time.time(), time.monotonic()
        sched = self.scheduler.schedule(start)
        if sched.empty:
            if sched.wake_at is not None:
                time.sleep(max(0.0, min(sched.wake_at - time.monotonic(), 0.05)))
            return []
        model_start = time.monotonic()
        results = self.runner.run(sched)
        now = time.monotonic()
        progress = self.scheduler.update_from_output(sched, results)
        outputs = [self._append_token(req, res.token, res.logprobs, now) for req, res in progress.sampled]
        self._record_step(sched, wall_start, start, now - model_start, progress.prefill_tokens,
                          progress.decode_seqs)
        self.counters["prompt_tokens"] += progress.prefill_tokens
        return outputs

    def _record_step(self, sched, wall_start: float, start: float, model_s: float, prefill_tokens: int,
                     decode_seqs: int) -> None:
        usage = self.cache.usage()
        self._num_steps += 1
        self.step_stats.append(StepRecord(
            step=self._num_steps, start=wall_start, end=wall_start + (time.monotonic() - start),
            start_monotonic=start, model_s=model_s, num_seqs=len(sched.seqs), num_tokens=sched.num_tokens,
            prefill_tokens=prefill_tokens, decode_tokens=sched.num_tokens - prefill_tokens,
            decode_seqs=decode_seqs, num_running=self.num_running, num_waiting=self.num_waiting,
            num_preempted=len(sched.preempted), pages_used=usage["pages_used"], slots_used=usage["slots_used"],
            request_ids=tuple(s.req.request_id for s in sched.seqs)))

    def _append_token(self, req: Request, token: int, logprobs, now: float) -> RequestOutput:
        self.counters["generation_tokens"] += 1
        if req.grammar is not None and not req.grammar.accept(token):  # the mask allowed it: a bug if seen
            log.error("request %s: token %d breaks its structured output: %s", req.request_id, token,
                      req.grammar.error)
        update = self.stop_checker.append(req, token, logprobs, now)
        if update.finish_reason is not None:
            return self._finish(req, update.finish_reason, now, update.stop_reason, update.delta, [token])
        return self._output(req, update.delta, [token])

    def _finish(self, req: Request, reason: str, now: float, stop=None, delta: str = "",
                delta_ids: list[int] | None = None) -> RequestOutput:
        if req.status is not Status.FINISHED:
            self.scheduler.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop
        req.metrics.finish_time = now
        self.finish_reasons[reason] += 1
        self.stop_checker.remove(req.request_id)
        out = self._output(req, delta, delta_ids or [])
        del self.requests[req.request_id]
        return out

    def _output(self, req: Request, delta: str, delta_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, text=req.text,
            token_ids=list(req.output_token_ids), finished=req.finished, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason, logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs,
            delta_text=delta, delta_token_ids=delta_ids, metrics=req.metrics,
            prompt=req.prompt, num_cached_tokens=req.num_cached_tokens or 0,
        )

    def stats(self) -> dict:
        return {"running": self.num_running, "waiting": self.num_waiting,
                "preemptions": self.scheduler.num_preemptions, **self.cache.usage(), **self.cache.prefix_stats(),
                **{f"tokens_{k}": v for k, v in self.counters.items()}}

    def snapshot(self) -> dict:
        """``stats()`` plus the finish-reason counts: what a server's /metrics reads, between steps."""
        return {**self.stats(), "finish_reasons": dict(self.finish_reasons)}
