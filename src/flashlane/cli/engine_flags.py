"""Engine flags shared by `generate` and `serve` (one definition, vLLM-like spelling)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..engine.engine_args import EngineArgs, check_sizes


def _memory(value: str) -> float | int:
    v = float(value)
    return v if v <= 1.0 else int(v)


def _sizes(value: str) -> tuple[int, ...]:
    try:
        return check_sizes([int(v) for v in value.split(",")])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes >= 1 (e.g. 1,2,4,8), "
                                         f"got {value!r}") from None


def _bytes(value: str) -> int:
    """A byte count: an integer >= 0, optionally with a K/M/G/T suffix (powers of 1024)."""
    text = value.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    if text and text[-1] in "KMGT":
        scale = 1024 ** ("KMGT".index(text[-1]) + 1)
        text = text[:-1]
    try:
        v = float(text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bytes (e.g. 536870912 or 512M), got {value!r}")
    if v < 0 or v != v:
        raise argparse.ArgumentTypeError(f"must be >= 0 bytes, got {value!r}")
    return int(v)


def _positive_bytes(value: str) -> int:
    v = _bytes(value)
    if v == 0:
        raise argparse.ArgumentTypeError("must be > 0 bytes")
    return v


def _speculative(value: str) -> dict:
    from ..engine.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(value).as_dict()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _share(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], got {value!r}")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value!r}")
    return v


def _positive_seconds(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {value!r}")
    return v


def _writable_dir(value: str) -> str:
    path = Path(value)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot create directory {value!r}: {e.strerror}")
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{value!r} is not a writable directory")
    return str(path)


def _at_least_one(value: str) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value!r}")
    return v


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    d = EngineArgs()
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                   help="weight and cache dtype; auto: on CPU bfloat16 where the CPU has native bf16 and a "
                        "start-up timing finds it >=10%% faster than float32 at 64 rows and no slower at 1 row, else float32 "
                        "(FLASHLANE_AUTO_DTYPE pins it; the reason is printed); on GPU the checkpoint's declared "
                        "dtype")
    p.add_argument("--seed", type=int, default=d.seed, help="random seed (random weights, sampling)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per cache page")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one engine step (prefill chunks plus decode tokens)")
    p.add_argument("--cache-memory", type=_memory, default=d.cache_memory,
                   help="KV/state cache budget: bytes, or a fraction (<= 1) of free memory")
    p.add_argument("--num-pages", type=int, default=None,
                   help="cache pages, overriding the --cache-memory split (default: from --cache-memory)")
    p.add_argument("--num-slots", type=int, default=None,
                   help="recurrent-state slots, overriding the --cache-memory split (default: from --cache-memory)")
    p.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms, help="dynamic batching window (0: off)")
    p.add_argument("--scheduler", choices=["continuous", "static"], default=d.scheduler,
                   help="continuous: requests join and leave every step; static: fixed batches of up to "
                        "--static-batch-size requests in arrival order, each run to completion before the "
                        "next starts (the naive baseline)")
    p.add_argument("--static-batch-size", type=_at_least_one, default=d.static_batch_size,
                   help="requests per batch with --scheduler static")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt plus output (default: the model's, capped by the cache)")
    p.add_argument("--num-threads", type=_at_least_one, default=None,
                   help="torch CPU threads (default: the CPUs not busy at start-up less one, at least 1; "
                        "printed at start)")
    p.add_argument("--quantization", choices=["int8", "w8a8", "gguf"], default=None,
                   help="int8 weights for every linear, the MoE experts and the LM head; w8a8 also "
                        "quantises activations per token where that measures faster (prefill on "
                        "VNNI/AMX CPUs); gguf (a .gguf model only) keeps the file's Q4_1/Q8_0 blocks and "
                        "quantises activations per block of 32, as llama.cpp does; the kernel choice is "
                        "printed at start-up (default: none)")
    p.add_argument("--kernel-backend", default=d.kernel_backend, metavar="NAME",
                   help="kernels the model ops run on: auto (the preferred backend for the device) or a "
                        "registered backend name (built in: cpu, the plain-torch kernels); the choice is "
                        "printed at start-up (default: auto)")
    p.add_argument("--linear-kernel", choices=["auto", "aten", "onednn", "native"], default=d.linear_kernel,
                   help="how the float linears' weights are held and multiplied: aten (as loaded, torch's "
                        "matmul), onednn (reordered once for oneDNN), native (as loaded; up to 16 rows "
                        "through flashlane's AVX2 kernel, float32), or auto: timed at start-up on this CPU, "
                        "onednn only where it is no slower at decode and 10%% faster at batch/prefill rows, "
                        "native only where it is 5%% faster at decode and no slower at 8 rows; static "
                        "graphs (--compile) and int8 keep theirs and ignore it; the choice is printed at "
                        "start-up (default: auto)")
    p.add_argument("--skip-tokenizer-init", action="store_true", default=d.skip_tokenizer_init,
                   help="load no tokenizer (a checkpoint without tokenizer.json): prompts and outputs are "
                        "token ids, output text is empty")
    g = p.add_argument_group("KV cache precision and sparse attention")
    g.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "int8"], default=d.kv_cache_dtype,
                   help="storage of the latent/KV pages and the pooled index keys: auto (the model dtype), "
                        "bfloat16, or int8 with fp32 per-token scales; KDA state stays fp32 (default: auto)")
    g.add_argument("--index-topk", type=_at_least_one, default=d.index_topk,
                   help="tokens each DSA query attends, overriding the config's index_topk (sparse-attention "
                        "models only; a multiple of index_kpool; default: the config's)")
    g = p.add_argument_group("prefix cache")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="share full pages by content between requests, with state checkpoints for hybrid "
                        "models (default: on)")
    g.add_argument("--checkpoint-share", type=_share, default=d.checkpoint_share,
                   help="fraction (0, 1] of --cache-memory for state checkpoints (hybrid models)")
    g.add_argument("--host-cache-memory", type=_bytes, default=d.host_cache_memory,
                   help="bytes of host memory for pages/checkpoints evicted from the pool (e.g. 2G; 0 = off)")
    g.add_argument("--disk-cache-dir", type=_writable_dir, default=None,
                   help="directory for the disk tier (kept across restarts of the same model and layout)")
    g.add_argument("--disk-cache-bytes", type=_positive_bytes, default=None,
                   help="byte budget of the disk tier (default: unbounded)")
    g.add_argument("--disk-load-timeout", dest="disk_load_timeout_s", type=_positive_seconds,
                   default=d.disk_load_timeout_s,
                   help="seconds a disk-tier load may take before it is given up and that part of the prompt "
                        f"is recomputed (default: {d.disk_load_timeout_s:g})")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-config", type=_speculative, default=None, metavar="JSON",
                   help='draft tokens verified in one step, as vLLM names it: {"method": "ngram", '
                        '"num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 4} (n-gram '
                        "prompt lookup, verified greedily or by rejection sampling; requests with logprobs or a "
                        "grammar decode without drafts; hybrid models roll rejected drafts back from a second "
                        "state row per slot; default: off)")
    g = p.add_argument_group("static-graph decode")
    g.add_argument("--compile", action="store_true",
                   help="compile the model's decode step once per batch-size bucket with torch.compile "
                        "(Inductor), warmed up at start-up, cached on disk under $FLASHLANE_CACHE/inductor; "
                        "decode steps are padded to the next bucket, prefill and larger batches run eagerly "
                        "(default: off)")
    g.add_argument("--compile-sizes", type=_sizes, default=d.compile_sizes,
                   help="comma-separated decode batch buckets compiled with --compile (capped at the "
                        f"sequences that can run at once; default: {','.join(map(str, d.compile_sizes))})")


def apply_thread_default(args: argparse.Namespace) -> None:
    """Before the engine (and torch) starts: fill in --num-threads when not given, prefer sleeping
    OpenMP threads, and say on stderr what was chosen (and when the machine is busy)."""
    from ..engine.threads import choose_threads, prefer_passive_waiting

    prefer_passive_waiting()
    choice = choose_threads(args.num_threads)
    if choice.set_here:
        args.num_threads = choice.threads
    print(choice.describe(), file=sys.stderr)
    if choice.warning():
        print(choice.warning(), file=sys.stderr)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in (
        "dtype", "seed", "page_size", "max_num_seqs", "max_num_batched_tokens", "cache_memory",
        "num_pages", "num_slots", "max_wait_ms", "max_model_len", "num_threads", "compile", "compile_sizes",
        "quantization",
        "scheduler", "static_batch_size",
        "kv_cache_dtype", "index_topk",
        "skip_tokenizer_init", "kernel_backend", "linear_kernel",
        "enable_prefix_caching", "checkpoint_share", "host_cache_memory", "disk_cache_dir", "disk_cache_bytes",
        "disk_load_timeout_s", "speculative_config")}


def _flags_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_engine_flags(p)
    return p


def engine_kwargs_of_flags(flags: list[str], where: str = "server flags") -> dict:
    """The engine arguments `flashlane serve` would run with for these flags (a stack's command,
    --serve-arg); an unknown or bad flag is a ValueError naming ``where``."""
    p = _flags_parser()
    try:
        ns, unknown = p.parse_known_args(list(flags))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if unknown:
        raise ValueError(f"{where}: not an engine flag of `flashlane serve` (or a value without its flag): "
                         f"{' '.join(unknown)}")
    return engine_kwargs(ns)


def flags_of_engine_kwargs(kwargs: dict) -> list[str]:
    """The `flashlane serve` flags that give these engine arguments (the ones off their default)."""
    out: list[str] = []
    for action in _flags_parser()._actions:
        if action.dest not in kwargs or not action.option_strings:
            continue
        value, flag = kwargs[action.dest], action.option_strings[0]
        if value == action.default or value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction):
            out += [flag] if value else []
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, (tuple, list)):
            out += [flag, ",".join(map(str, value))]
        else:
            out += [flag, str(value)]
    return out
