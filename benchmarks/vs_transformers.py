"""(a) flashlane LLM.generate (eager and static-graph decode) vs transformers generate on the
same weights, same prompts, the same torch threads.

Batch 1 and 16, greedy, fixed output length; reports generated tokens/s for each and the ratios,
plus the aten-level operator calls of one decode step (torch.profiler events named ``aten::*``,
nested calls included, counted the same way for both engines). transformers is loaded with
flashlane's own weights (identical parameter names), so all run the same model.

    python benchmarks/vs_transformers.py --models tiny-flash,tiny-standard,smollm2-135m
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import write_result

from flashlane import LLM, SamplingParams
from flashlane.models.registry import load_model


def hf_model(loaded, dtype):
    import transformers

    cfg = loaded.config
    if cfg.arch == "llama" and str(loaded.path).endswith(".gguf"):
        p = Path(loaded.path)
        return transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, torch_dtype=dtype)
    raw = dict(cfg.raw)
    if cfg.arch == "glm5_next":
        text = raw.get("text_config", raw)
        hcfg = transformers.Glm5NextConfig(
            text_config=text,
            vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                               out_hidden_size=text["hidden_size"], projection_intermediate_size=64))
        model = transformers.Glm5NextForConditionalGeneration(hcfg)
    elif cfg.arch == "glm_moe_dsa":
        model = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**raw))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**raw))
    missing, unexpected = model.load_state_dict(loaded.model.state_dict(), strict=False)
    missing = [k for k in missing if ".visual." not in k and not k.startswith("model.visual")]
    if missing:
        raise RuntimeError(f"transformers model lacks weights for {missing[:5]}")
    return model.to(dtype).eval()


def time_hf(model, prompts: torch.Tensor, new_tokens: int) -> float:
    with torch.inference_mode():
        model.generate(prompts[:1, :8], max_new_tokens=2, do_sample=False)  # warm-up
        t = time.perf_counter()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
        dt = time.perf_counter() - t
    assert out.shape[1] - prompts.shape[1] == new_tokens
    return dt


def time_flashlane(llm: LLM, prompts: torch.Tensor, new_tokens: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompts[0, :8].tolist()], SamplingParams(max_tokens=2))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts.tolist(), params)
    dt = time.perf_counter() - t
    assert all(len(o.token_ids) == new_tokens for o in outs)
    return dt


def aten_calls_per_decode_step(llm: LLM, prompts: torch.Tensor) -> int:
    """aten::* profiler events of one engine step while every prompt is decoding."""
    from torch.profiler import profile

    eng = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts.tolist()):
        eng.add_request(f"ops{i}", p, params)
    while any(not r.output_token_ids for r in eng.requests.values()):
        eng.step()
    eng.step()
    with profile() as prof:
        eng.step()
    for rid in list(eng.requests):
        eng.abort(rid)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-flash,tiny-standard,smollm2-135m")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-compile", action="store_true", help="skip the static-graph decode engine")
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name in args.models.split(","):
        loaded = load_model(name, dtype=args.dtype)
        hf = hf_model(loaded, dtype)
        llm = LLM(loaded, dtype=args.dtype, max_num_seqs=64)
        compiled = None if args.no_compile else LLM(loaded, dtype=args.dtype, max_num_seqs=64, compile=True,
                                                    compile_sizes=batches)
        g = torch.Generator().manual_seed(0)
        vocab = min(loaded.config.vocab_size, 30000)
        for bsz in batches:
            prompts = torch.randint(10, vocab, (bsz, args.prompt_len), generator=g)
            t_hf = time_hf(hf, prompts, args.new_tokens)
            t_fl = time_flashlane(llm, prompts, args.new_tokens)
            n = bsz * args.new_tokens
            row = {"model": name, "batch": bsz, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
                   "transformers_tok_s": n / t_hf, "flashlane_tok_s": n / t_fl, "speedup": t_hf / t_fl,
                   "aten_calls_per_step_eager": aten_calls_per_decode_step(llm, prompts)}
            if compiled is not None:
                t_c = time_flashlane(compiled, prompts, args.new_tokens)
                row.update(flashlane_compiled_tok_s=n / t_c, speedup_compiled=t_hf / t_c,
                           aten_calls_per_step_compiled=aten_calls_per_decode_step(compiled, prompts),
                           compile_warmup_s=compiled.engine.info.compiled_decode["warmup_s"])
                row["dispatch_cut"] = row["aten_calls_per_step_eager"] / row["aten_calls_per_step_compiled"]
            print(row, flush=True)
            rows.append(row)
        del hf, llm, compiled
    write_result("vs_transformers", {"dtype": args.dtype, "threads": torch.get_num_threads(), "rows": rows},
                 args.out)


if __name__ == "__main__":
    main()
