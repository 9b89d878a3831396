"""Where a decode step's time goes: wall time and aten-op count per module kind, plus the
torch.profiler top operators, for one preset at batch 1 and 16 (decode) and one prefill chunk.

    python benchmarks/profile_step.py --model tiny-flash [--compile]
"""

from __future__ import annotations

import argparse
import collections
import time

from common import write_result
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from flashlane import SamplingParams
from flashlane.engine.llm_engine import LLMEngine

KINDS = ("KDAAttention", "DSAAttention", "LlamaAttention", "MoE", "MLP", "LlamaMLP", "HyperConnection", "RMSNorm")


class _CountOps(TorchDispatchMode):
    def __init__(self, stack, counts):
        super().__init__()
        self.stack, self.counts = stack, counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.stack[-1] if self.stack else "other"] += 1
        return func(*args, **(kwargs or {}))


def _instrument(model, stack, times):
    def pre(m, _):
        stack.append(type(m).__name__)
        m._t0 = time.perf_counter()

    def post(m, _a, _o):
        stack.pop()
        times[type(m).__name__] += time.perf_counter() - m._t0

    for m in model.modules():
        if type(m).__name__ in KINDS:
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)


def profile_decode(eng: LLMEngine, batch: int, steps: int, stack: list, times: collections.Counter) -> dict:
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}", [10 + (7 * i + j) % 3000 for j in range(64)],
                        SamplingParams(max_tokens=steps + 10, temperature=0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    counts: collections.Counter = collections.Counter()
    times.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    module_ms = {k: 1000 * v / steps for k, v in times.items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step()
    top = [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1000, "calls": e.count}
           for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]]
    with _CountOps(stack, counts):
        eng.step()
    while eng.has_unfinished():
        eng.step()
    return {"batch": batch, "step_ms": step_ms, "module_ms_per_step": module_ms,
            "aten_ops_per_step": sum(counts.values()), "ops_by_module": dict(counts.most_common()), "top_ops": top}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-flash")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    eng = LLMEngine(args.model, dtype="float32", num_threads=args.threads, compile=args.compile)
    stack: list[str] = []
    times: collections.Counter = collections.Counter()
    _instrument(eng.model, stack, times)
    rows = [profile_decode(eng, b, args.steps, stack, times) for b in (1, 16)]
    eng.add_request("prefill", [10 + j % 3000 for j in range(1024)], SamplingParams(max_tokens=1))
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    write_result(f"profile_step_{args.model}{'_compiled' if args.compile else ''}", {
        "model": args.model, "threads": args.threads, "compile": args.compile, "decode": rows,
        "prefill_1024_s": time.perf_counter() - t0}, args.out)


if __name__ == "__main__":
    main()
