"""Engine flags shared by `generate` and `serve` (one definition, vLLM-like spelling)."""

from __future__ import annotations

import argparse

from ..engine.engine_args import EngineArgs


def _memory(value: str) -> float | int:
    v = float(value)
    return v if v <= 1.0 else int(v)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    d = EngineArgs()
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--cache-memory", type=_memory, default=d.cache_memory,
                   help="KV/state cache budget: bytes, or a fraction (<= 1) of free memory")
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--num-slots", type=int, default=None)
    p.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms, help="dynamic batching window")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quantization", choices=["int8"], default=None,
                   help="weight-only int8 linear layers (faster small-batch decode on CPU)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the mHC math (compiled at start-up; ~15%% faster single-threaded "
                        "offline decode, measured slower under `serve` on 2 CPU cores)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in (
        "dtype", "seed", "page_size", "max_num_seqs", "max_num_batched_tokens", "cache_memory",
        "num_pages", "num_slots", "max_wait_ms", "max_model_len", "num_threads", "compile", "quantization")}
