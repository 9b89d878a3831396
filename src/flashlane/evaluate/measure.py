"""Speed and memory of one loaded engine, measured beside its accuracy."""

from __future__ import annotations

from ..engine.sampling_params import SamplingParams


def cache_bytes(startup: dict) -> dict[str, float]:
    """Per-token bytes of the paged pools and per-sequence bytes of the state slots, as the
    engine planned them from ``cache_spec``."""
    if "pool_bytes_per_token" in startup:
        per_token = float(sum(startup["pool_bytes_per_token"].values()))
    else:
        per_token = float(startup["latent_bytes_per_token"] + startup["index_bytes_per_token"])
    return {"cache_bytes_per_token": per_token, "state_bytes_per_sequence": startup["bytes_per_slot"]}


def throughput(llm, prompt_ids: list[int], decode_tokens: int, batches: tuple[int, ...]) -> dict[str, float]:
    """Prefill tok/s (one prompt of ``prompt_ids``, alone) and decode tok/s at each batch size,
    from the engine's own step records: prefill = prompt tokens / time of steps that only
    prefill; decode = tokens / time of steps that only decode."""
    engine = llm.engine
    out: dict[str, float] = {}
    engine.step_stats.clear()
    llm.generate([prompt_ids], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    steps = [s for s in engine.step_stats if s.prefill_tokens and s.decode_seqs == 0]
    out["prefill_tok_s"] = sum(s.prefill_tokens for s in steps) / max(sum(s.duration for s in steps), 1e-9)
    short = prompt_ids[:32]
    for batch in batches:
        # distinct prompts (a different first token each), so no two share a cached page
        prompts = [[(short[0] + i) % engine.config.vocab_size] + short[1:] for i in range(batch)]
        engine.step_stats.clear()
        llm.generate(prompts, SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True))
        steps = [s for s in engine.step_stats if s.prefill_tokens == 0]
        tokens = sum(s.num_tokens for s in steps)
        out[f"decode_tok_s_b{batch}"] = tokens / max(sum(s.duration for s in steps), 1e-9)
        out[f"decode_mean_batch_b{batch}"] = tokens / max(len(steps), 1)
    return out
