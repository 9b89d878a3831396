"""`flashlane prune MODEL --out DIR`: structured pruning into a Hugging Face checkpoint folder."""

from __future__ import annotations

import argparse
import time

from .help import HelpFormatter


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prune", help="drop MoE experts and/or MLP channels, write an HF checkpoint",
        description="Structured pruning calibrated on text. Experts (glm5_next / glm_moe_dsa): REAP-style "
                    "saliency, the mean over the tokens routed to an expert of gate weight x ||expert "
                    "output||, lowest dropped per layer. MLP channels (llama, dense GLM layers, routed and "
                    "shared experts): mean |activation| x ||down_proj column||, lowest dropped per layer. "
                    "Calibration windows come from the end of the corpus (default: Python's pydoc_data "
                    "topics). The folder (config.json, model.safetensors, tokenizer) loads in flashlane "
                    "and transformers; the MTP block is dropped.",
        formatter_class=HelpFormatter)
    p.add_argument("model", help="checkpoint folder, .gguf file or preset")
    p.add_argument("--out", required=True, help="folder to create (absent or empty)")
    p.add_argument("--experts-keep", default=None,
                   help="routed experts kept per MoE layer: a count (12) or a fraction (0.5)")
    p.add_argument("--mlp-keep", type=float, default=None,
                   help="fraction of every MLP's intermediate channels kept, in (0, 1]")
    p.add_argument("--calibration-tokens", type=int, default=4096, help="calibration tokens in all")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration window")
    p.add_argument("--corpus", default=None,
                   help="calibration text: plain text or JSONL with a 'text' field (default: pydoc_data.topics)")
    return p


def run(args) -> int:
    from ..compress.calibration import corpus_windows
    from ..compress.checkpoint import check_out_dir, trunk_state, write_checkpoint
    from ..compress.prune import plan_pruning, prune_model
    from ..models.registry import load_model

    if args.calibration_tokens < args.seq_len:
        raise ValueError(f"--calibration-tokens ({args.calibration_tokens}) is less than one --seq-len window "
                         f"({args.seq_len})")
    out = check_out_dir(args.out)
    loaded = load_model(args.model, dtype="float32")
    plan = plan_pruning(loaded.model, loaded.config, args.experts_keep, args.mlp_keep)
    windows = corpus_windows(loaded.tokenizer, args.corpus, args.seq_len, args.calibration_tokens // args.seq_len)
    t0 = time.perf_counter()
    state, config = prune_model(loaded.model, loaded.config, plan, windows)
    write_checkpoint(out, state, config, source=loaded.path, tokenizer=loaded.tokenizer)
    before = sum(t.numel() for t in trunk_state(loaded.model, loaded.config).values())
    after = sum(t.numel() for t in state.values())
    for line in plan.summary(loaded.config):
        print(line)
    print(f"calibrated on {len(windows)} x {args.seq_len} tokens in {time.perf_counter() - t0:.1f} s; "
          f"parameters (no MTP, tied once) {before:,} -> {after:,}")
    print(out)
    return 0
