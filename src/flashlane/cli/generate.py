"""`flashlane generate --model M --prompt TEXT`: offline generation, printed to stdout."""

from __future__ import annotations

import json
import time

from .engine_flags import add_engine_flags, engine_kwargs


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text offline")
    p.add_argument("--model", required=True, help="preset, checkpoint folder or .gguf file")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt with the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_flags(p)
    return p


def run(args) -> int:
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    for prompt, o in zip(args.prompt, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason}))
        else:
            print(f"--- {prompt!r}\n{o.text}")
    if not args.json:
        print(f"[{n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tok/s]")
    return 0
