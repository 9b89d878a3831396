"""What structured output costs: the grammar's work per decode step (fill the token mask, apply it
to the logits rows, accept the sampled tokens) beside the engine's decode step, at batch 1 and 8,
and what compiling costs (llguidance's tokenizer once per engine, each schema once).

    python benchmarks/structured_output.py [--models tiny-flash,smollm2-135m] [--steps 24]

The grammar cost is measured by replaying a valid document's tokens through B matchers (every
row constrained, the worst case); the decode step is the engine's own, B unconstrained requests.
The machine may be shared: the load average is recorded beside the numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from common import write_result

from flashlane import SamplingParams
from flashlane.engine.llm_engine import LLMEngine
from flashlane.engine.sampling_params import StructuredOutput
from flashlane.engine.structured_output import Grammars

SMALL = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
         "properties": {"name": {"type": "string", "maxLength": 8},
                        "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
MID = {"type": "object", "required": ["id", "title", "status", "owner"], "properties": {
    "id": {"type": "integer"}, "title": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5},
    "status": {"enum": ["open", "closed", "pending"]},
    "owner": {"type": "object", "required": ["name", "admin"], "properties": {
        "name": {"type": "string"}, "email": {"type": "string"}, "admin": {"type": "boolean"}}},
    "score": {"type": "number"},
    "items": {"type": "array", "items": {"type": "object", "required": ["sku", "qty"], "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}}},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}
# a valid document of MID (properties in the schema's order, the engine's compact separators)
MID_DOC = ('{"id": 7, "title": "fix the cache eviction order", "tags": ["cache", "bug"], "status": "open", '
           '"owner": {"name": "ann", "admin": true}, "items": [{"sku": "x1", "qty": 2}], "note": null}')


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


def compile_costs(tokenizer, width: int, eos) -> dict:
    grammars = Grammars(tokenizer, width, eos)
    t = time.perf_counter()
    grammars._tokenizer()
    out = {"tokenizer_s": round(time.perf_counter() - t, 3)}
    for name, schema in (("small", SMALL), ("mid", MID)):
        t = time.perf_counter()
        grammars.matcher(StructuredOutput(json_schema=schema))
        out[f"{name}_compile_ms"] = ms(time.perf_counter() - t)
        t = time.perf_counter()
        grammars.matcher(StructuredOutput(json_schema=schema))
        out[f"{name}_cached_ms"] = ms(time.perf_counter() - t)   # a copy of the compiled matcher
    return out


def grammar_step_ms(tokenizer, width: int, eos, batch: int) -> dict:
    """Per step, B rows: mask (fill + apply) and accept, replaying MID_DOC's tokens."""
    grammars = Grammars(tokenizer, width, eos)
    doc = tokenizer.encode(MID_DOC, add_special_tokens=False)
    structured = StructuredOutput(json_schema=MID)
    grammars.matcher(structured)                  # compiled outside the timing
    matchers = [grammars.matcher(structured) for _ in range(batch)]
    logits = torch.randn(batch, width)
    mask_s, accept_s = [], []
    for token in doc:
        rows = logits.clone()
        t = time.perf_counter()
        grammars.mask(rows, matchers)
        mask_s.append(time.perf_counter() - t)
        assert torch.isfinite(rows[:, token]).all(), "the document's next token was masked out"
        t = time.perf_counter()
        for m in matchers:
            assert m.accept(token)
        accept_s.append(time.perf_counter() - t)
    return {"steps": len(doc), "mask_ms": ms(statistics.mean(mask_s)), "mask_p90_ms": ms(sorted(mask_s)[
        int(0.9 * len(mask_s))]), "accept_ms": ms(statistics.mean(accept_s)),
        "grammar_ms": ms(statistics.mean(mask_s) + statistics.mean(accept_s))}


def decode_step_ms(eng: LLMEngine, batch: int, steps: int, structured: StructuredOutput | None) -> float:
    """Mean duration of the engine's pure decode steps for ``batch`` requests."""
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, structured=structured)
    for i in range(batch):
        eng.add_request(f"b{batch}-{i}-{structured is not None}", f"Request {i}: reply in JSON.", params)
    eng.step_stats.clear()
    while eng.has_unfinished():
        eng.step()
    times = [s.end - s.start for s in eng.step_stats if s.prefill_tokens == 0 and s.decode_seqs == batch]
    return ms(statistics.mean(times)) if times else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-flash,smollm2-135m")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    runs = []
    for model in args.models.split(","):
        eng = LLMEngine(model, dtype="float32", num_threads=args.threads, cache_memory=256 << 20)
        tok, width, eos = eng.tokenizer, eng.config.vocab_size, eng.config.eos_token_ids
        run = {"model": model, "tokenizer_vocab": tok.vocab_size, "logits_width": width,
               "compile": compile_costs(tok, width, eos), "batches": []}
        # a schema whose one string never has to close: every row stays constrained for all steps
        open_string = StructuredOutput(json_schema={"type": "object", "required": ["text"],
                                                    "properties": {"text": {"type": "string"}}})
        for b in (1, 8):
            grammar = grammar_step_ms(tok, width, eos, b)
            step = decode_step_ms(eng, b, args.steps, None)
            step_constrained = decode_step_ms(eng, b, args.steps, open_string)
            run["batches"].append({"batch": b, "grammar": grammar, "decode_step_ms": step,
                                   "decode_step_constrained_ms": step_constrained,
                                   "grammar_share_of_step": round(grammar["grammar_ms"] / step, 4) if step else None})
        runs.append(run)
        print(run, flush=True)
    import llguidance
    write_result("structured_output", {
        "library": f"llguidance {llguidance.__version__ if hasattr(llguidance, '__version__') else ''}".strip(),
        "threads": args.threads, "steps": args.steps, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "note": "machine shared with other jobs while measured: see loadavg; decode_step_constrained_ms may "
                "end early for rows whose string closed (only full-batch decode steps are counted)",
        "runs": runs}, args.out)


if __name__ == "__main__":
    main()
