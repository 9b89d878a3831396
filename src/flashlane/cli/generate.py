"""`flashlane generate --model M --prompt TEXT`: offline generation, printed to stdout."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .engine_flags import add_engine_flags, apply_thread_default, engine_kwargs
from .help import HelpFormatter


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {text!r}")
    return ids


def _prompt_mode(flag: bool | None, chat: bool, own_template: bool) -> str:
    """The one stderr line saying how --prompt text reached the model."""
    if not chat:
        return ("raw text (--no-chat)" if flag is False else
                "raw text (the model has no chat template of its own; --chat for the generic one)")
    template = "the model's chat template" if own_template else "the generic chat template"
    return f"rendered with {template} ({'--chat' if flag else '--no-chat for raw text'})"


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text offline", formatter_class=HelpFormatter)
    p.add_argument("--model", required=True, help="preset, checkpoint folder or .gguf file")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-token-ids", action="append", type=_token_ids, default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable; the only kind of "
                        "prompt with --skip-tokenizer-init)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="render each --prompt as a user message with the chat template; --no-chat sends "
                        "the raw text (default: chat when the model ships its own template)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="sample from the k most likely tokens (-1: off)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_flags(p)
    return p


def run(args) -> int:
    if not args.prompt and not args.prompt_token_ids:
        raise ValueError("give at least one --prompt or --prompt-token-ids")
    if args.skip_tokenizer_init and (args.prompt or args.chat):
        raise ValueError("--skip-tokenizer-init loads no tokenizer: give prompts with --prompt-token-ids "
                         "(no --prompt, no --chat)")
    apply_thread_default(args)   # before torch loads
    from ..engine.llm import LLM
    from ..engine.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    prompts = list(args.prompt)
    if prompts:
        # an instruct model fed raw text often ends at once: chat unless told, when it has a template
        chat = llm.tokenizer.has_own_chat_template if args.chat is None else args.chat
        print(f"prompt: {_prompt_mode(args.chat, chat, llm.tokenizer.has_own_chat_template)}", file=sys.stderr)
        if chat:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate(prompts + list(args.prompt_token_ids), params)
    dt = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    for prompt, o in zip(list(args.prompt) + list(args.prompt_token_ids), outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason}))
        elif llm.tokenizer is None:
            print(f"--- {prompt!r}\n{' '.join(map(str, o.token_ids))}")
        else:
            print(f"--- {prompt!r}\n{o.text}")
    if not args.json:
        print(f"[{n} tokens in {dt:.2f}s, {n / max(dt, 1e-9):.1f} tok/s]")
    return 0
