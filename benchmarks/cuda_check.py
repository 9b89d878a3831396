"""The cuda kernel backend on a GPU machine, in one run of a few minutes: fidelity, then speed.

1. kda op: the cuda backend (fla-core's chunk_kda / fused_recurrent_kda) on the GPU against the cpu
   backend on CPU -- a mixed step (decode tokens, fresh prefills, prefill chunks carrying on from a
   state, lengths around fla's 64-token chunks) and a pure decode step, fp32;
2. models (tiny-flash, tiny-standard, a tiny llama, fp32): logits of three steps (prefills, a mixed
   step with a chunk carrying on, a padded static decode) within a relative tolerance, and greedy
   tokens through the engine equal; then the compiled (CUDA-graph) decode's greedy tokens;
3. speed, paired and interleaved: the kda op (H=16, D=128, bf16: prefill of 1K/4K/16K tokens,
   decode batch 1 and 8) and tiny-flash forwards, plain-torch kernels on the GPU vs the cuda backend.

    python benchmarks/cuda_check.py                 # on a GPU: cpu backend on CPU vs cuda on the GPU
    python benchmarks/cuda_check.py --dry-run       # CPU only: the same code, cpu backend on both sides

The JSON goes to --out, else $OUT/cuda_check.json when $OUT is set, else
benchmarks/results/cuda_check.json; it says whether it ran on a GPU (``ran_on_gpu``) and which.
Exit status 1 when a fidelity check failed (the numbers are in the JSON either way).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
from common import write_result

from flashlane.cache_spec import cache_spec
from flashlane.config import parse_config
from flashlane.engine.cache.pools import allocate_pools
from flashlane.engine.llm import LLM
from flashlane.engine.sampling_params import SamplingParams
from flashlane.kernels.backends import select_backend
from flashlane.kernels.backends.cuda import fla_version
from flashlane.models.forward_batch import ForwardBatch

# Relative tolerances: max |test - ref| / max |ref|. fla's Triton dots may run fp32 inputs in TF32
# on the GPU (about 1e-3 relative per product), so these are looser than fp32 rounding.
KDA_TOL = 5e-3
LOGITS_TOL = 2e-2


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-12)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Sides:
    """Reference (cpu backend on CPU) and test side (cuda backend on the GPU; --dry-run: cpu/cpu)."""

    def __init__(self, dry_run: bool):
        self.ref_device, self.ref_backend = torch.device("cpu"), "cpu"
        self.test_device = torch.device("cpu" if dry_run else "cuda")
        self.test_backend = "cpu" if dry_run else "cuda"

    def ref_ops(self):
        return select_backend(self.ref_device, self.ref_backend)

    def test_ops(self):
        return select_backend(self.test_device, self.test_backend)


# ---- 1. the kda op ------------------------------------------------------------------------------

def kda_meta(q_lens, start_lens, slots, device):
    """What the kda op reads of a batch (as ForwardBatch.build makes it)."""
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    ctx = torch.tensor([s + q for s, q in zip(start_lens, q_lens)])
    return SimpleNamespace(q_lens=list(q_lens), cu_q=cu.to(device), ctx_lens_t=ctx.to(device),
                           state_slots=torch.tensor(slots).to(device), is_decode=all(q == 1 for q in q_lens),
                           static=False)


def kda_inputs(n, h, d, slots_total, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(dtype) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(n, h, d, generator=gen))        # the lower-bound gate form (fp32)
    beta = torch.rand(n, h, generator=gen).to(dtype)
    pool = torch.randn(slots_total, h, d, d, generator=gen) * 0.1
    return [q, k, v, g, beta], pool


def check_kda_op(sides: Sides) -> dict:
    cases = {
        # decode carrying on, fresh prefill over two chunks, fresh decode, chunk carrying on,
        # a 1-chunk-exact prefill and a long one from a state
        "mixed": ([1, 130, 1, 70, 64, 300], [9, 0, 0, 40, 0, 12], [2, 5, 1, 3, 7, 4]),
        "decode": ([1] * 8, [0, 3, 17, 1, 0, 200, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8]),
    }
    out = {}
    for h, d in ((4, 32), (16, 128)):
        for name, (q_lens, starts, slots) in cases.items():
            inputs, pool = kda_inputs(sum(q_lens), h, d, 9, torch.float32)
            ref_pool, test_pool = pool.clone(), pool.to(sides.test_device)
            want = sides.ref_ops().kda(*inputs, ref_pool, kda_meta(q_lens, starts, slots, sides.ref_device))
            got = sides.test_ops().kda(*(x.to(sides.test_device) for x in inputs), test_pool,
                                       kda_meta(q_lens, starts, slots, sides.test_device))
            res = {"out_rel": rel_diff(got, want), "state_rel": rel_diff(test_pool, ref_pool)}
            res["ok"] = res["out_rel"] <= KDA_TOL and res["state_rel"] <= KDA_TOL
            out[f"{name}_h{h}_d{d}"] = res
    return out


# ---- 2. models -----------------------------------------------------------------------------------

def tiny_llama():
    from flashlane.models.llama import LlamaForCausalLM

    cfg = parse_config(dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=4096, eos_token_id=2))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return SimpleNamespace(model=model.eval(), config=cfg, tokenizer=None, name="tiny-llama", path=None)


def load(name: str):
    if name == "tiny-llama":
        return tiny_llama()
    from flashlane.models.registry import load_model

    return load_model(name, dtype="float32")


def on_device(loaded, device):
    if device.type == "cpu":
        return loaded
    return SimpleNamespace(model=copy.deepcopy(loaded.model).to(device), config=loaded.config,
                           tokenizer=loaded.tokenizer, name=loaded.name, path=None)


def prompts(n_tokens: list[int], vocab: int, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 250), (n,), generator=gen).tolist() for n in n_tokens]


# (a, b1, b2, c): sequence 0 prefills a tokens then decodes; sequence 1 prefills b1, then a chunk
# of b2 carries on from its state; sequence 2 is a fresh prefill of c. On a GPU they straddle
# fla's 64-token chunks; the dry run keeps them short (its CPU forwards are slow).
STEP_LENGTHS = {"gpu": (100, 40, 70, 130), "dry-run": (10, 6, 7, 13)}
GREEDY_PROMPTS = {"gpu": ([5, 70, 150], 12), "dry-run": ([5, 9], 3)}      # prompt lengths, new tokens


def step_logits(loaded, device, ops, lengths) -> list[torch.Tensor]:
    """Three forwards on a fresh cache: two prefills; a decode beside a prefill chunk carrying on
    from its state and a fresh prefill; a padded decode of all three (static)."""
    a, b1, b2, c = lengths
    page = 16
    pages = -(-(max(a, b1 + b2, c) + 1) // page)
    spec = cache_spec(loaded.config, page)
    cache = allocate_pools(spec, 1 + 3 * pages, 4, torch.float32, device)
    tables = [list(range(1 + pages * b, 1 + pages * (b + 1))) for b in range(3)]
    slots = [1, 2, 3] if spec.needs_state_slot else [0, 0, 0]
    seqs = prompts([a + 2, b1 + b2 + 1, c + 1], loaded.config.vocab_size)
    steps = [([0, 1], [seqs[0][:a], seqs[1][:b1]], [0, 0]),
             ([0, 1, 2], [seqs[0][a:a + 1], seqs[1][b1:b1 + b2], seqs[2][:c]], [a, b1, 0])]
    out = []
    with torch.no_grad():
        for ids, new, starts in steps:
            batch = ForwardBatch.build(new, starts, [tables[b] for b in ids], [slots[b] for b in ids], cache, ops=ops)
            out.append(loaded.model.compute_logits(loaded.model(batch)))
        last = [a + 1, b1 + b2, c]
        batch = ForwardBatch.padded_decode([seqs[b][p] for b, p in enumerate(last)], last, tables, slots, cache,
                                           size=4, width=pages, ops=ops)
        out.append(loaded.model.compute_logits(loaded.model(batch))[:3])
    return out


def greedy(loaded, device, backend, sizes, **engine_args) -> list[list[int]]:
    lengths, new = sizes
    llm = LLM(loaded, dtype="float32", device=str(device), kernel_backend=backend, max_num_seqs=4,
              cache_memory=64 * 2**20, skip_tokenizer_init=True, **engine_args)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts(lengths, loaded.config.vocab_size, seed=2), params)]


def check_models(sides: Sides, names: list[str], with_compile: bool, deadline: float, mode: str) -> dict:
    lengths, sizes = STEP_LENGTHS[mode], GREEDY_PROMPTS[mode]
    out = {}
    for name in names:
        res = out[name] = {}
        try:
            ref = load(name)
            test = on_device(ref, sides.test_device)
            want = step_logits(ref, sides.ref_device, sides.ref_ops(), lengths)
            got = step_logits(test, sides.test_device, sides.test_ops(), lengths)
            res["logits_rel"] = [rel_diff(g, w) for g, w in zip(got, want)]
            res["argmax_equal"] = all(torch.equal(g.argmax(-1).cpu(), w.argmax(-1)) for g, w in zip(got, want))
            ref_tokens = greedy(ref, sides.ref_device, sides.ref_backend, sizes)
            res["greedy_equal"] = greedy(test, sides.test_device, sides.test_backend, sizes) == ref_tokens
            res["ok"] = max(res["logits_rel"]) <= LOGITS_TOL and res["greedy_equal"]
            if with_compile and name == "tiny-flash":
                if time.monotonic() > deadline:
                    res["compiled_greedy_equal"] = "skipped: time budget"
                else:   # the compiled decode buckets: CUDA-graph trees on the GPU
                    t0 = time.monotonic()
                    tokens = greedy(test, sides.test_device, sides.test_backend, sizes, compile=True,
                                    compile_sizes=(1, 4))
                    res["compiled_greedy_equal"] = tokens == ref_tokens
                    res["compiled_s"] = round(time.monotonic() - t0, 1)
                    res["ok"] = res["ok"] and res["compiled_greedy_equal"]
        except Exception as exc:   # one model's failure is recorded, the others still run
            res.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
    return out


# ---- 3. speed ----------------------------------------------------------------------------------

def paired_ms(fns: dict, device, repeats: int) -> dict:
    """Median ms of each variant, the variants interleaved round by round (one warm-up round)."""
    times = {k: [] for k in fns}
    for r in range(repeats + 1):
        for k, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            if r:
                times[k].append(1000 * (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in times.items()}


def variants(sides: Sides) -> dict:
    """Plain-torch kernels vs the backend under test, both on the test device."""
    return {"torch": select_backend(sides.test_device, "cpu"), sides.test_backend: sides.test_ops()}


def bench_kda(sides: Sides, prefill_lens, decode_batches, repeats, deadline, ctx) -> dict:
    dev, h, d = sides.test_device, 16, 128
    out = {}
    cases = [("prefill", n, [n], [0], [1]) for n in prefill_lens]
    cases += [("decode", b, [1] * b, [ctx] * b, list(range(1, b + 1))) for b in decode_batches]
    for kind, size, q_lens, starts, slots in cases:
        key = f"{kind}_{size}"
        if time.monotonic() > deadline:
            out[key] = "skipped: time budget"
            continue
        inputs, pool = kda_inputs(sum(q_lens), h, d, len(slots) + 1, torch.bfloat16)
        inputs, pool = [x.to(dev) for x in inputs], pool.to(dev)
        meta = kda_meta(q_lens, starts, slots, dev)
        fns = {name: (lambda ops=ops, inputs=inputs, pool=pool, meta=meta: ops.kda(*inputs, pool, meta))
               for name, ops in variants(sides).items()}
        ms = paired_ms(fns, dev, repeats)
        tokens = sum(q_lens)
        out[key] = {"tokens": tokens, "ms": ms, "tok_per_s": {k: tokens / (v / 1000) for k, v in ms.items()}}
    return out


def bench_model(sides: Sides, prefill_lens, decode_batches, repeats, deadline, ctx) -> dict:
    """tiny-flash forwards: a prefill of n tokens, one decode step of b sequences at context ``ctx``."""
    dev = sides.test_device
    loaded = on_device(load("tiny-flash"), dev)
    page = 16
    spec = cache_spec(loaded.config, page)
    longest = max([*prefill_lens, ctx + 1])
    pages_per_seq = -(-longest // page)
    seqs = max(decode_batches)
    cache = allocate_pools(spec, 1 + seqs * pages_per_seq, seqs + 1, torch.float32, dev)
    tables = [list(range(1 + b * pages_per_seq, 1 + (b + 1) * pages_per_seq)) for b in range(seqs)]
    tokens = prompts([longest], loaded.config.vocab_size)[0]
    out = {}

    def forward(batch):
        with torch.no_grad():
            return loaded.model.compute_logits(loaded.model(batch))

    cases = [("prefill", n) for n in prefill_lens] + [("decode", b) for b in decode_batches]
    for kind, size in cases:
        key = f"{kind}_{size}"
        if time.monotonic() > deadline:
            out[key] = "skipped: time budget"
            continue
        fns = {}
        for name, ops in variants(sides).items():
            if kind == "prefill":
                batch = ForwardBatch.build([tokens[:size]], [0], [tables[0]], [1], cache, ops=ops)
            else:   # the cache content is whatever the prefills left: the speed does not depend on it
                batch = ForwardBatch.build([[tokens[ctx]]] * size, [ctx] * size, tables[:size],
                                           list(range(1, size + 1)), cache, ops=ops)
            fns[name] = lambda batch=batch: forward(batch)
        ms = paired_ms(fns, dev, repeats)
        n = size
        out[key] = {"tokens": n, "ms": ms, "tok_per_s": {k: n / (v / 1000) for k, v in ms.items()}}
    return out


# ---- main --------------------------------------------------------------------------------------

def environment(sides: Sides) -> dict:
    gpu = torch.cuda.is_available()
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": gpu,
            "device_name": torch.cuda.get_device_name(0) if gpu else None, "fla_core": fla_version(),
            "test_side": f"{sides.test_backend} backend on {sides.test_device}",
            "ref_side": f"{sides.ref_backend} backend on {sides.ref_device}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU only: the cpu backend on both sides, small sizes")
    ap.add_argument("--models", default="tiny-flash,tiny-standard,tiny-llama")
    ap.add_argument("--prefill", default=None, help="prefill lengths (default 1024,4096,16384; dry run 64,128)")
    ap.add_argument("--decode", default="1,8", help="decode batch sizes")
    ap.add_argument("--decode-context", type=int, default=None, help="context of the decode steps (default 1024; "
                    "dry run 32)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per case (default 5; dry run 1)")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="compiled (CUDA-graph) decode check; auto: on a GPU only")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--budget-s", type=float, default=270.0, help="speed cases past this many seconds are skipped")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    start = time.monotonic()
    deadline = start + args.budget_s
    if not args.dry_run and not torch.cuda.is_available():
        ap.error(f"torch {torch.__version__} sees no CUDA GPU: run on a GPU machine, or --dry-run to test the "
                 "script on CPU")
    sides = Sides(args.dry_run)
    sides.test_ops()     # a clear error (what is missing, the pip extra) before anything runs
    prefill = [int(x) for x in (args.prefill or ("64,128" if args.dry_run else "1024,4096,16384")).split(",")]
    decode = [int(x) for x in args.decode.split(",")]
    repeats = args.repeats or (1 if args.dry_run else 5)
    ctx = args.decode_context or (32 if args.dry_run else 1024)
    with_compile = args.compile == "on" or (args.compile == "auto" and not args.dry_run)

    result = {"mode": "dry-run" if args.dry_run else "gpu", "ran_on_gpu": sides.test_device.type == "cuda",
              "environment": environment(sides), "tolerances": {"kda_rel": KDA_TOL, "logits_rel": LOGITS_TOL},
              "errors": []}
    fidelity = result["fidelity"] = {}
    seconds = result["section_seconds"] = {}
    for name, fn in (("kda_op", lambda: check_kda_op(sides)),
                     ("models", lambda: check_models(sides, args.models.split(","), with_compile, deadline,
                                                     result["mode"]))):
        t0 = time.monotonic()
        try:
            fidelity[name] = fn()
        except Exception as exc:
            fidelity[name] = {"error": {"ok": False, "error": f"{type(exc).__name__}: {exc}"}}
            result["errors"].append(traceback.format_exc()[-3000:])
        seconds[name] = round(time.monotonic() - t0, 1)
    result["ok"] = all(case.get("ok") for section in fidelity.values() for case in section.values())
    if not args.no_bench:
        bench = result["bench"] = {}
        for name, fn in (("kda_op_h16_d128_bf16", bench_kda), ("tiny_flash_forward", bench_model)):
            t0 = time.monotonic()
            try:
                bench[name] = fn(sides, prefill, decode, repeats, deadline, ctx)
            except Exception as exc:
                bench[name] = {"error": f"{type(exc).__name__}: {exc}"}
                result["errors"].append(traceback.format_exc()[-3000:])
            seconds[name] = round(time.monotonic() - t0, 1)
    result["seconds"] = round(time.monotonic() - start, 1)
    out = args.out or (str(Path(os.environ["OUT"]) / "cuda_check.json") if os.environ.get("OUT") else None)
    write_result("cuda_check", result, out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
