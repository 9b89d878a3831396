"""What a stream sends must add up to the final text, also when a stop string spans several
tokens (the engine holds back a tail that may still become a stop string)."""

from __future__ import annotations

from flashlane import LLM, SamplingParams
from flashlane.engine.llm_engine import LLMEngine
from flashlane.engine.stop_checker import stop_prefix_len

from engine_models import tiny_llama


def _stream(engine: LLMEngine, prompt, params) -> tuple[str, object]:
    engine.add_request("r", prompt, params)
    deltas, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.delta_text)
            assert out.text == "".join(deltas)  # cumulative text never runs ahead of the deltas
            last = out
    return "".join(deltas), last


def test_stop_prefix_len():
    assert stop_prefix_len("hello wo", 0, ["world"]) == 2
    assert stop_prefix_len("hello wo", 7, ["world"]) == 0  # only text from `start` on counts
    assert stop_prefix_len("hello w", 6, ["world"]) == 1
    assert stop_prefix_len("hello", 0, ["xyz", "lo!"]) == 2
    assert stop_prefix_len("hello", 0, ["q"]) == 0


def test_streamed_deltas_equal_final_text_for_every_stop():
    m = tiny_llama()
    prompt = [65, 66, 67, 68, 69, 70, 71]
    llm = LLM(m, dtype="float32", cache_memory=8 << 20)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = llm.generate([prompt], greedy)[0].text
    assert len(ref) >= 8
    engine = llm.engine
    stops = {ref[i:i + k] for k in (2, 3, 5) for i in range(0, len(ref) - k, 3)} | {"no such stop"}
    for stop in sorted(stops):
        text, last = _stream(engine, prompt, SamplingParams(**{**vars(greedy), "stop": [stop]}))
        want = ref[:ref.find(stop)] if stop in ref else ref
        assert text == want == last.text, stop
        assert last.finish_reason == ("stop" if stop in ref else "length")
