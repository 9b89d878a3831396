"""The client side of a request's outputs (OutputProcessor): engine deltas in, RequestOutputs out.
Stop strings across token boundaries, a tail held while it may still become one, the stop
token's text left out, and the three output kinds holding what they say (the DELTA pieces add
up to the FINAL output)."""

from __future__ import annotations

import copy

import pytest

from flashlane.engine.output_processor import OutputProcessor, stop_prefix_len
from flashlane.engine.outputs import RequestDelta
from flashlane.engine.sampling_params import OutputKind, SamplingParams

from engine_models import ByteTokenizer

PROMPT = [1, 2, 3]


class PieceTokenizer:
    """Token id i decodes to PIECES[i]: tokens of several characters, so a stop string can end
    inside one, or span several."""

    PIECES = ["<s>", "</s>", "Hel", "lo", " wor", "ld", "!", " S", "TO", "P", "x", "END"]

    def decode(self, ids, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        return "".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i < 2))

    @classmethod
    def ids(cls, *pieces: str) -> list[int]:
        return [cls.PIECES.index(p) for p in pieces]


def _delta(rid: str, ids: list[int], t: float, finish: str | None = None, stop_token: int | None = None,
           first: bool = False, logprobs: bool = False, prompt_logprobs=None) -> RequestDelta:
    return RequestDelta(rid, ids, [{i: -0.5} for i in ids] if logprobs else None, t, finish, stop_token,
                        first_scheduled_time=t - 0.5 if first else None,
                        prompt_logprobs=prompt_logprobs if first else None)


def _deltas(steps: list[list[int]], rid: str = "r", finish: str = "length", stop_token: int | None = None,
            **kw) -> list[RequestDelta]:
    """One delta per step, the last one finished with ``finish``."""
    last = len(steps) - 1
    return [_delta(rid, ids, 10.0 + i, finish if i == last else None, stop_token if i == last else None,
                   first=i == 0, **kw) for i, ids in enumerate(steps)]


def _run(tokenizer, deltas: list[RequestDelta], **params) -> tuple[list, list[bool], OutputProcessor]:
    """The outputs handed on (None skipped) and, per delta, whether the processor stopped it."""
    proc = OutputProcessor(tokenizer)
    proc.add(deltas[0].request_id, PROMPT, SamplingParams(**params), arrival_time=9.0, prompt="p")
    outs, stopped = [], []
    for d in deltas:
        processed = proc.process(d)
        stopped.append(processed.stopped)
        if processed.output is not None:
            outs.append(processed.output)
    return outs, stopped, proc


def test_stop_prefix_len():
    assert stop_prefix_len("hello wo", 0, ["world"]) == 2
    assert stop_prefix_len("hello wo", 7, ["world"]) == 0  # only text from `start` on counts
    assert stop_prefix_len("hello w", 6, ["world"]) == 1
    assert stop_prefix_len("hello", 0, ["xyz", "lo!"]) == 2
    assert stop_prefix_len("hello", 0, ["q"]) == 0


STEPS = [PieceTokenizer.ids("Hel", "lo"), PieceTokenizer.ids(" wor"), PieceTokenizer.ids("ld", "!"),
         PieceTokenizer.ids(" S"), PieceTokenizer.ids("TO"), PieceTokenizer.ids("x"), PieceTokenizer.ids("END")]


def test_the_three_output_kinds_hold_what_they_say():
    kw = dict(temperature=0, logprobs=1, prompt_logprobs=1)
    plp = [None, {2: -1.0}, {3: -2.0}]
    deltas = _deltas(STEPS, logprobs=True, prompt_logprobs=plp)
    final, _, _ = _run(PieceTokenizer(), deltas, output_kind=OutputKind.FINAL_ONLY, **kw)
    cumulative, _, _ = _run(PieceTokenizer(), deltas, output_kind=OutputKind.CUMULATIVE, **kw)
    delta, _, _ = _run(PieceTokenizer(), deltas, output_kind=OutputKind.DELTA, **kw)
    all_ids = [t for step in STEPS for t in step]

    (f,) = final
    assert f.finished and f.finish_reason == "length" and f.text == "Hello world! STOxEND"
    assert f.token_ids == all_ids and f.num_output_tokens == len(all_ids)
    assert f.logprobs == [{t: -0.5} for t in all_ids] and f.prompt_logprobs == plp
    assert f.prompt_token_ids == PROMPT and f.prompt == "p"
    m = f.metrics
    assert (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finish_time) == (9.0, 9.5, 10.0, 16.0)
    assert m.token_times == [10.0 + i for i, step in enumerate(STEPS) for _ in step]

    assert len(cumulative) == len(delta) == len(STEPS)
    assert cumulative[-1].text == f.text and cumulative[-1].token_ids == f.token_ids
    assert [o.text for o in cumulative] == ["Hello", "Hello wor", "Hello world!", "Hello world! S",
                                            "Hello world! STO", "Hello world! STOx", f.text]
    assert all(o.prompt_logprobs == plp for o in cumulative)

    assert "".join(o.text for o in delta) == f.text
    assert [o.token_ids for o in delta] == STEPS
    assert [o.num_output_tokens for o in delta] == [len(o.token_ids) for o in cumulative]
    assert [lp for o in delta for lp in o.logprobs] == f.logprobs
    assert delta[0].prompt_logprobs == plp and all(o.prompt_logprobs is None for o in delta[1:])
    assert [o.finished for o in delta] == [False] * (len(STEPS) - 1) + [True]


def test_a_stop_string_across_tokens_is_held_then_cut():
    outs, stopped, proc = _run(PieceTokenizer(), _deltas(STEPS[:5] + [PieceTokenizer.ids("P", "x")]),
                               stop=["STOP"], output_kind=OutputKind.DELTA)
    # " S" and " ST" may still become the stop string: held, not sent
    assert [o.text for o in outs] == ["Hello", " wor", "ld!", " ", "", ""]
    last = outs[-1]
    assert last.finished and last.finish_reason == "stop" and last.stop_reason == "STOP"
    assert stopped == [False] * 5 + [True]    # the caller must abort the engine request
    assert len(proc) == 0 and "r" not in proc
    assert last.token_ids == PieceTokenizer.ids("P", "x") and last.num_output_tokens == 9
    assert proc.process(_delta("r", [2], 20.0)).output is None   # the engine's late deltas are dropped


def test_a_held_tail_that_does_not_become_a_stop_is_sent():
    outs, stopped, _ = _run(PieceTokenizer(), _deltas(STEPS), stop=["STOP"], output_kind=OutputKind.DELTA)
    assert [o.text for o in outs] == ["Hello", " wor", "ld!", " ", "", "STOx", "END"]
    assert not any(stopped) and outs[-1].finish_reason == "length"


def test_a_stop_string_inside_one_token_and_the_earliest_of_several_wins():
    steps = [PieceTokenizer.ids("Hel", "lo"), PieceTokenizer.ids(" wor", "ld")]
    outs, stopped, _ = _run(PieceTokenizer(), _deltas(steps, finish="length"), stop=["orl", "lo w"])
    assert outs[-1].text == "Hel" and outs[-1].stop_reason == "lo w" and stopped == [False, True]
    outs, _, _ = _run(PieceTokenizer(), _deltas(steps), stop=["ell"])
    assert outs[0].finished and outs[0].text == "H" and outs[0].stop_reason == "ell"


def test_the_final_output_releases_what_was_held():
    steps = [PieceTokenizer.ids("Hel", "lo"), PieceTokenizer.ids(" S")]
    outs, _, _ = _run(PieceTokenizer(), _deltas(steps), stop=["STOP"], output_kind=OutputKind.DELTA)
    assert [o.text for o in outs] == ["Hello", " S"] and outs[-1].finish_reason == "length"


def test_the_stop_tokens_text_is_left_out():
    bang = PieceTokenizer.ids("!")[0]
    steps = [PieceTokenizer.ids("Hel", "lo"), [bang]]
    for kind in OutputKind:
        outs, stopped, _ = _run(PieceTokenizer(), _deltas(steps, finish="stop", stop_token=bang), output_kind=kind)
        last = outs[-1]
        assert (last.finish_reason, last.stop_reason) == ("stop", bang) and not any(stopped)
        text = "".join(o.text for o in outs) if kind is OutputKind.DELTA else last.text
        assert text == "Hello"
        assert last.num_output_tokens == 3 and bang in last.token_ids   # the token itself is kept (vLLM)


def test_an_abort_delta_finishes_with_what_was_there():
    deltas = [_delta("r", PieceTokenizer.ids("Hel", "lo"), 10.0, first=True), _delta("r", [], 11.0, "abort")]
    outs, _, proc = _run(PieceTokenizer(), deltas)
    assert outs[-1].finished and outs[-1].finish_reason == "abort" and outs[-1].text == "Hello"
    assert len(proc) == 0


def test_half_a_utf8_character_waits_for_the_rest():
    snowman = "☃".encode()                     # three bytes, three tokens of the byte tokenizer
    steps = [[ord("a")], [snowman[0]], [snowman[1]], [snowman[2], ord("b")]]
    outs, _, _ = _run(ByteTokenizer(), _deltas(steps), output_kind=OutputKind.DELTA)
    assert [o.text for o in outs] == ["a", "", "", "☃b"]


def test_without_a_tokenizer_there_is_no_text():
    outs, _, _ = _run(None, _deltas([[5, 6], [7]]))
    assert [o.text for o in outs] == ["", ""] and outs[-1].token_ids == [5, 6, 7]


def test_requests_are_kept_apart_and_removed_requests_get_nothing():
    proc = OutputProcessor(PieceTokenizer())
    params = SamplingParams(output_kind=OutputKind.DELTA)
    for rid in ("a", "b"):
        proc.add(rid, PROMPT, params, arrival_time=1.0)
    a = proc.process(_delta("a", PieceTokenizer.ids("Hel"), 2.0, first=True)).output
    b = proc.process(_delta("b", PieceTokenizer.ids("END"), 2.0, first=True)).output
    assert (a.request_id, a.text, b.request_id, b.text) == ("a", "Hel", "b", "END")
    proc.remove("a")
    assert proc.process(_delta("a", PieceTokenizer.ids("lo"), 3.0)).output is None
    assert len(proc) == 1


@pytest.mark.parametrize("kind", list(OutputKind))
def test_an_output_handed_on_is_not_changed_by_later_ones(kind):
    # a consumer may keep an output while the next ones are built: what it holds must not move
    proc = OutputProcessor(PieceTokenizer())
    proc.add("r", PROMPT, SamplingParams(logprobs=1, output_kind=kind), arrival_time=9.0)
    kept = []
    for d in _deltas(STEPS, logprobs=True):
        out = proc.process(d).output
        if out is not None:
            kept.append((out, copy.deepcopy((out.token_ids, out.text, out.logprobs, out.num_output_tokens))))
    assert kept
    for out, then in kept:
        assert (out.token_ids, out.text, out.logprobs, out.num_output_tokens) == then
