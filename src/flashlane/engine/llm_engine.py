"""The synchronous engine: add requests, call ``step()``; the offline LLM and the async server
engine both drive it."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter

import torch

from ..cache_spec import cache_spec
from ..kernels.backends import select_backend
from ..kernels.linear_plan import LinearPlan, choose_linear_plan
from ..models.dsa_attention import check_index_topk
from ..models.loader import auto_cpu_dtype_choice
from ..models.packed_linear import PackReport, pack_linears
from ..models.protocol import CausalLM, Compilable
from ..models.protocol import MtpDrafter as MtpDrafterModel
from ..models.gguf_blocks import GgufReport, keep_gguf_blocks
from ..models.quantize import Int8Embedding, quantize, weight_bytes
from .cache.fingerprint import weights_fingerprint
from .cache.manager import CacheManager, CachePlan, plan_cache
from .compiled_decode import CompiledDecode, cuda_graph_mode
from .scheduler_choice import build_scheduler, max_running_seqs
from .speculative import MtpPass
from .engine_args import EngineArgs
from .host_malloc import keep_freed_memory
from .info import EngineInfo
from .outputs import RequestDelta
from .request import Request
from .request_check import InvalidRequest, check_prompt_ids, check_sampling, resolve_max_tokens
from .runner import ModelRunner
from .sampling_params import SamplingParams
from .step_log import StepLog, StepRecord
from .structured_output import Grammars

log = logging.getLogger("flashlane.engine")


def _model_dtype(model) -> torch.dtype:
    """The model's float dtype: its token embedding's (an int8 table remembers the float one)."""
    emb = next(m for m in model.modules() if isinstance(m, (torch.nn.Embedding, Int8Embedding)))
    return emb.float_dtype if isinstance(emb, Int8Embedding) else emb.weight.dtype


# dtype "auto" with GGUF blocks on a CPU (see LLMEngine._gguf_float32)
GGUF_DTYPE_REASON = "auto with quantization gguf: float32, the activations the block kernels quantise (as llama.cpp)"


class LLMEngine:
    def __init__(self, model, **engine_args):
        args = EngineArgs.from_kwargs(**engine_args)
        args.validate()
        self.args = args
        self.speculative = args.speculative()     # None: speculative decoding off
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.host_malloc = keep_freed_memory() if torch.device(args.device).type == "cpu" else None
        self.ops = select_backend(args.device, args.kernel_backend)   # once, for every op of every step
        loaded_here = isinstance(model, str)
        self._load(model)
        mtp = self.speculative is not None and self.speculative.method == "mtp"
        if mtp and not (isinstance(self.model, MtpDrafterModel) and self.model.with_mtp):
            raise ValueError(f"speculative_config.method 'mtp' needs the model's MTP layer: {self.model_name} "
                             f"({self.config.arch}) has none (num_nextn_predict_layers = "
                             f"{self.config.num_mtp_layers}, or no MTP weights in the checkpoint)")
        spec = cache_spec(self.config, args.page_size, args.kv_cache_dtype, mtp=mtp)
        plan = self._build_cache(spec)          # (its disk-tier fingerprint reads the weights as loaded)
        self.weight_bytes = weight_bytes(self.model)
        self.linears = self._pack_linears(loaded_here)
        self.max_model_len = min(args.max_model_len or self.config.max_position_embeddings, plan.num_tokens)
        max_running = max_running_seqs(args, spec, plan)
        self.scheduler = build_scheduler(args, self.config, self.cache, max_running)
        compiled = self._compiled_decode(spec, max_running) if args.compile else None
        self.grammars = Grammars(self.tokenizer, self.config.vocab_size, self.config.eos_token_ids)
        s = self.speculative
        mtp_pass = (MtpPass(self.model, self.cache, s.num_speculative_tokens, args.index_topk, self.ops, compiled)
                    if mtp else None)
        self.runner = ModelRunner(self.model, self.cache, args.seed, args.index_topk, compiled, self.grammars,
                                  ops=self.ops, mtp=mtp_pass, synthetic_rate=s.synthetic_rate if s else None)
        self.requests: dict[str, Request] = {}
        self.step_stats = StepLog(args.step_log_size)
        self._num_steps = 0
        self.counters: Counter = Counter()
        self.spec_counters: Counter = Counter()
        self.finish_reasons: Counter = Counter()
        self.info = self._engine_info(spec, plan, max_running, loaded_here)
        log.info(self.describe_weights())
        log.info(self.describe_cache())
        if compiled is not None:
            w = compiled.warm_up()
            self.info = dataclasses.replace(self.info, compiled_decode={
                "sizes": list(w.sizes), "warmup_s": round(w.seconds, 2), "cache_dir": w.cache_dir,
                "mode": w.mode, "graphs": w.graphs})
            log.info("%s; %s compilation: %d graphs", self.info.describe_compile(), w.mode, w.graphs)
        if args.compile:
            self._warm_up()

    def _gguf_float32(self) -> bool:
        """dtype "auto" with GGUF blocks on a CPU means float32: the block kernels quantise float32
        activations per block, as llama.cpp does (a bf16 model would take torch's slow emulation)."""
        args = self.args
        return args.quantization == "gguf" and args.dtype == "auto" and torch.device(args.device).type == "cpu"

    def _load_dtype(self) -> str:
        return "float32" if self._gguf_float32() else self.args.dtype

    def _load(self, model) -> None:
        args = self.args
        if isinstance(model, str):
            from ..models.registry import load_model
            model = load_model(model, dtype=self._load_dtype(), seed=args.seed, device=args.device,
                               require_tokenizer=not args.skip_tokenizer_init)
        self.loaded = model
        if not isinstance(model.model, CausalLM):
            raise TypeError(f"{type(model.model).__name__} is not a CausalLM (forward(batch), compute_logits(hidden))")
        self.model: CausalLM = model.model
        self.dtype = _model_dtype(self.model)
        if args.quantization == "gguf":
            self.quant = keep_gguf_blocks(self.model, getattr(model, "path", None), self.ops)
        else:
            self.quant = (quantize(self.model, args.quantization, device=args.device, ops=self.ops)
                          if args.quantization else None)
        if isinstance(self.model, Compilable):
            self.model.set_compile(args.compile)
        self.config = model.config
        if args.index_topk is not None:
            check_index_topk(self.config, args.index_topk)
        self.index_topk = (args.index_topk or self.config.index_topk) if self.config.full_indexer_layers else None
        self.tokenizer = None if args.skip_tokenizer_init else model.tokenizer  # None: token ids only
        self.model_name = model.name

    def _pack_linears(self, loaded_here: bool) -> PackReport:
        """The float linears' weight format: timed or named (engine arg linear_kernel); static
        graphs and int8 weights keep theirs, and "auto" leaves a model object it was given as it
        is (packing replaces modules in place, under the caller's feet)."""
        args = self.args
        if args.compile:
            plan = LinearPlan("aten", f"compile: Inductor lays out the weights of a compiled step (linear_kernel "
                                      f"{args.linear_kernel!r} not applied)")
        elif args.quantization:
            plan = LinearPlan("aten", f"quantization {args.quantization}: the linears are quantised "
                                      f"(linear_kernel {args.linear_kernel!r} not applied)")
        elif args.linear_kernel == "auto" and not loaded_here:
            plan = LinearPlan("aten", "auto leaves a model object it was given as loaded (linear_kernel "
                                      "'onednn' packs it in place)")
        else:
            plan = choose_linear_plan(args.linear_kernel, self.dtype, args.device)
        report = pack_linears(self.model, plan, self.ops)
        log.info(report.describe())
        return report

    def _build_cache(self, spec) -> CachePlan:
        args = self.args
        plan = plan_cache(spec, self.dtype, args.cache_memory, args.max_num_seqs,
                          args.num_pages, args.num_slots, args.device,
                          checkpoint_share=args.checkpoint_share if args.enable_prefix_caching else 0.0,
                          num_checkpoints=args.num_checkpoints if args.enable_prefix_caching else 0,
                          draft_rollback=self.speculative is not None)
        fingerprint = f"{self.model_name}|{self.config.arch}|{self._dtype_name()}|index_topk={self.index_topk}"
        if args.disk_cache_dir:
            fingerprint += "|" + weights_fingerprint(self.model)
        try:
            self.cache = CacheManager(spec, plan, self.dtype, args.device, args.enable_prefix_caching, fingerprint,
                                      args.host_cache_memory, args.disk_cache_dir, args.disk_cache_bytes,
                                      args.disk_load_timeout_s)
        except OSError as e:
            raise ValueError(f"disk_cache_dir {args.disk_cache_dir!r} is not a writable directory: {e}") from e
        return plan

    def _compiled_decode(self, spec, max_running: int) -> CompiledDecode:
        args = self.args
        # buckets count rows: a stateless model verifies drafts as one row per token
        s = self.speculative
        rows = max_running * (1 + s.num_speculative_tokens if s is not None and not spec.needs_state_slot else 1)
        sizes = [b for b in args.compile_sizes if b < rows] + [min(rows, args.compile_sizes[-1])]
        # a model with per-sequence state verifies drafts in graphs of its own (1 + k tokens each)
        verify_rows = 1 + s.num_speculative_tokens if s is not None and spec.needs_state_slot else 1
        mtp = s is not None and s.method == "mtp"
        # the MTP layer's catch-up covers 1..k+1 committed tokens; with its indexer tail in order
        catch_up = tuple(range(2, 2 + s.num_speculative_tokens)) if mtp and spec.kpool > 1 else ()
        return CompiledDecode(self.model, self.cache.tensors, sizes, args.index_topk,
                              min_width=-(-(self.index_topk or 0) // spec.page_size),
                              mode=cuda_graph_mode(args.device), ops=self.ops, verify_rows=verify_rows,
                              mtp=mtp, mtp_rows=catch_up, hidden=(self.config.hidden_size, self.dtype))

    def _engine_info(self, spec, plan: CachePlan, max_running: int, loaded_here: bool) -> EngineInfo:
        args, config = self.args, self.config
        dtype_name = self._dtype_name()
        has_indexer = bool(config.full_indexer_layers)
        return EngineInfo(
            model=self.model_name, arch=config.arch, dtype=dtype_name,
            vocab_size=config.vocab_size, max_model_len=self.max_model_len, max_running=max_running,
            page_size=spec.page_size, num_pages=plan.num_pages, num_tokens=plan.num_tokens,
            num_state_slots=plan.num_slots, bytes_per_page=plan.bytes_per_page,
            bytes_per_slot=plan.bytes_per_slot, cache_bytes=self.cache.tensors.nbytes(),
            latent_bytes_per_token=spec.latent_bytes_per_token(dtype_name),
            index_bytes_per_token=spec.index_bytes_per_token(dtype_name),
            kv_cache_dtype=spec.kv_dtype_name(dtype_name),
            pool_bytes_per_token=spec.page_bytes_per_token(dtype_name),
            index_topk=self.index_topk, config_index_topk=config.index_topk if has_indexer else None,
            prefix_caching=args.enable_prefix_caching, num_checkpoints=plan.num_checkpoints,
            bytes_per_checkpoint=plan.bytes_per_slot if plan.num_checkpoints else 0,
            host_cache_bytes=args.host_cache_memory if args.enable_prefix_caching else 0,
            disk_cache_dir=args.disk_cache_dir, disk_cache_bytes=args.disk_cache_bytes,
            scheduler=args.scheduler,
            static_batch_size=args.static_batch_size if args.scheduler == "static" else None,
            weight_bytes=self.weight_bytes + self.linears.extra_bytes, quantization=self._quant_report(),
            quantization_summary="no quantization" if self.quant is None else self.quant.describe(),
            dtype_reason=(GGUF_DTYPE_REASON if self._gguf_float32() and loaded_here
                          else auto_cpu_dtype_choice().why if args.dtype == "auto" and loaded_here
                          and torch.device(args.device).type == "cpu" else None),
            num_threads=torch.get_num_threads(),
            host_malloc=None if self.host_malloc is None else self.host_malloc.as_dict(),
            kernel_backend={"name": self.ops.name, "description": self.ops.describe()},
            linear_kernel=self.linears.as_dict(),
            speculative=None if self.speculative is None else {
                **self.speculative.as_dict(), "rollback_rows": plan.num_draft_rows,
                "mtp_bytes_per_token": spec.mtp_bytes_per_token(dtype_name),
                "rollback_bytes": plan.num_draft_rows * spec.draft_rollback_bytes_per_sequence(dtype_name),
                # static graphs: verify steps run through them (with per-sequence state, regional
                # graphs and k drafts for every sequence of the step)
                "verify_in_graphs": None if self.runner.compiled is None
                else not spec.needs_state_slot or self.runner.compiled.verify_rows > 1,
                "verify_state_bytes": 0 if self.runner.compiled is None or self.runner.compiled.step_states is None
                else self.runner.compiled.step_states.nbytes()},
        )

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
        self.spec_counters.clear()
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
        if isinstance(q, GgufReport):
            return q.as_dict()
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
                raise InvalidRequest("this engine has no tokenizer (skip_tokenizer_init=True, or a checkpoint "
                                     "without tokenizer.json): give prompts as lists of token ids", "prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, keep_prompt_logprob_rows: bool = False) -> Request:
        """Queue a request (its checks are ``request_check``'s; a refusal raises InvalidRequest)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        ids = self.tokenize(prompt)
        check_prompt_ids(ids, self.config.vocab_size, self.max_model_len)
        check_sampling(params, self.tokenizer is not None)
        max_tokens = resolve_max_tokens(len(ids), params.max_tokens, self.max_model_len)
        grammar = self.grammars.matcher(params.structured) if params.structured is not None else None
        req = Request(request_id, ids, params, self.config.eos_token_ids, arrival_time, max_tokens, grammar,
                      keep_prompt_logprob_rows)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.counters["requests_added"] += 1
        return req

    def abort(self, request_id: str, reason: str = "abort") -> RequestDelta | None:
        """End a request that has not finished; its last delta (None if there was nothing to end).
        ``reason`` "stop": a client found a stop string in its text."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.scheduler.finish(req, reason, None)
        return self._retire(req, self._delta(req, 0, time.monotonic()))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Schedule and run one batch; the deltas of every request that sampled or finished."""
        wall_start, start = time.time(), time.monotonic()
        sched = self.scheduler.schedule(start)
        if sched.empty:
            if sched.wake_at is not None:
                time.sleep(max(0.0, min(sched.wake_at - time.monotonic(), 0.05)))
            return []
        model_start = time.monotonic()
        cached = tuple(s.req.num_computed_tokens for s in sched.seqs)   # before the step advances them
        results = self.runner.run(sched)
        now = time.monotonic()
        progress = self.scheduler.update_from_output(sched, results)
        if progress.accepted:
            self._count_drafts(progress)
        deltas = [self._delta(req, n, now) for req, n in progress.sampled]
        for d in deltas:
            if d.finished:
                self._retire(self.requests[d.request_id], d)
        self._record_step(sched, wall_start, start, now - model_start, progress, cached)
        self.counters["prompt_tokens"] += progress.prefill_tokens
        self.counters["generation_tokens"] += sum(n for _, n in progress.sampled)
        return deltas

    def _count_drafts(self, progress) -> None:
        """Speculative decoding counters (vLLM's): drafts verified, accepted, accepted by position."""
        c = self.spec_counters
        c["spec_drafts"] += len(progress.accepted)
        c["spec_draft_tokens"] += progress.drafted
        c["spec_accepted_tokens"] += sum(progress.accepted)
        for n in progress.accepted:
            for pos in range(n):
                c[f"spec_accepted_pos{pos}"] += 1

    def _delta(self, req: Request, num_new: int, now: float) -> RequestDelta:
        """What ``req`` gained this step: its last ``num_new`` tokens (and the rest on its first)."""
        first = len(req.output_token_ids) == num_new   # its first tokens, or an abort before any
        ids = req.output_token_ids[len(req.output_token_ids) - num_new:] if num_new else []
        logprobs = None if req.logprobs is None else req.logprobs[len(req.logprobs) - num_new:] if num_new else []
        return RequestDelta(
            req.request_id, ids, logprobs, now, req.finish_reason, req.stop_reason,
            num_cached_tokens=req.num_cached_tokens or 0, num_preemptions=req.metrics.num_preemptions,
            num_draft_tokens=req.metrics.num_draft_tokens, num_accepted_tokens=req.metrics.num_accepted_tokens,
            first_scheduled_time=req.metrics.first_scheduled_time if first else None,
            prompt_logprobs=req.prompt_logprobs if first else None)

    def _retire(self, req: Request, delta: RequestDelta) -> RequestDelta:
        self.finish_reasons[req.finish_reason] += 1
        del self.requests[req.request_id]
        return delta

    def _record_step(self, sched, wall_start: float, start: float, model_s: float, progress,
                     cached: tuple[int, ...]) -> None:
        usage = self.cache.usage()
        mtp = self.runner.mtp
        self._num_steps += 1
        self.step_stats.append(StepRecord(
            step=self._num_steps, start=wall_start, end=wall_start + (time.monotonic() - start),
            start_monotonic=start, model_s=model_s,
            sample_s=self.runner.last_sample_s, num_seqs=len(sched.seqs), num_tokens=sched.num_tokens,
            prefill_tokens=progress.prefill_tokens, decode_tokens=sched.num_tokens - progress.prefill_tokens,
            decode_seqs=progress.decode_seqs, num_running=self.num_running, num_waiting=self.num_waiting,
            num_preempted=len(sched.preempted), pages_used=usage["pages_used"], slots_used=usage["slots_used"],
            request_ids=tuple(s.req.request_id for s in sched.seqs),
            seq_new_tokens=tuple(s.num_new for s in sched.seqs), seq_cached_tokens=cached,
            draft_tokens=progress.drafted, accepted_tokens=sum(progress.accepted),
            seq_draft_tokens=tuple(len(s.draft) for s in sched.seqs),
            draft_calls=mtp.calls if mtp is not None else 0, draft_rows=mtp.rows if mtp is not None else 0,
            draft_logit_rows=mtp.logit_rows if mtp is not None else 0))

    def stats(self) -> dict:
        return {"running": self.num_running, "waiting": self.num_waiting,
                "preemptions": self.scheduler.num_preemptions, **self.cache.usage(), **self.cache.prefix_stats(),
                **{f"tokens_{k}": v for k, v in self.counters.items()}, **self.spec_counters}

    def snapshot(self) -> dict:
        """``stats()`` plus the finish-reason counts: what a server's /metrics reads, between steps."""
        return {**self.stats(), "finish_reasons": dict(self.finish_reasons)}
