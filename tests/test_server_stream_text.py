"""What a stream sends must add up to the final text, also when a stop string spans several
tokens (the client holds back a tail that may still become a stop string): the server's
streams are the engine client's DELTA outputs."""

from __future__ import annotations

import asyncio
import dataclasses

from flashlane import LLM, SamplingParams
from flashlane.engine.launch import engine_in_thread
from flashlane.engine.sampling_params import OutputKind

from engine_models import tiny_llama

ARGS = dict(dtype="float32", cache_memory=8 << 20)


def test_streamed_deltas_equal_final_text_for_every_stop():
    prompt = [65, 66, 67, 68, 69, 70, 71]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = LLM(tiny_llama(), **ARGS).generate([prompt], greedy)[0].text
    assert len(ref) >= 8
    stops = {ref[i:i + k] for k in (2, 3, 5) for i in range(0, len(ref) - k, 3)} | {"no such stop"}
    client = engine_in_thread(tiny_llama(), **ARGS)   # the model exists only in this process
    client.start()

    async def stream(rid: str, stop: str) -> tuple[list, list]:
        params = dataclasses.replace(greedy, stop=[stop])
        deltas = [o async for o in client.generate(rid, prompt, dataclasses.replace(params, output_kind=OutputKind.DELTA))]
        final = [o async for o in client.generate(rid + "-final", prompt,
                                                  dataclasses.replace(params, output_kind=OutputKind.FINAL_ONLY))]
        return deltas, final

    try:
        for i, stop in enumerate(sorted(stops)):
            deltas, (final,) = asyncio.run(stream(f"r{i}", stop))
            want = ref[:ref.find(stop)] if stop in ref else ref
            assert "".join(o.text for o in deltas) == want == final.text, stop
            assert deltas[-1].finish_reason == final.finish_reason == ("stop" if stop in ref else "length")
            assert deltas[-1].stop_reason == final.stop_reason == (stop if stop in ref else None)
    finally:
        client.shutdown()
