"""The typed messages between an engine client and its engine core (``core.py``), whichever
transport carries them: a queue to a thread of this process, or a pipe to an engine process.

client -> core:
  ``Call(call_id, command)``   a command answered by ``Reply(call_id, ...)``
  ``AbortRequests``            fire and forget; each request still running sends its last delta
  ``Stop``                     close the engine and leave the loop
core -> client:
  ``Ready`` / ``LoadFailed``   once, from an engine process, after the model loaded (or did not)
  ``StepOutputs``              after every step that changed any request
  ``Reply``                    a call's result, or the exception it raised
  ``EngineDied``               a step crashed (message and formatted traceback); nothing follows
"""

from __future__ import annotations

from dataclasses import dataclass

from .info import EngineInfo
from .outputs import RequestDelta
from .sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float          # time.monotonic() of the client (system-wide on Linux)


# ---- commands (inside a Call) --------------------------------------------------------------------
@dataclass(slots=True)
class AddRequests:
    """All are added, or none (the first refusal is the call's exception)."""
    requests: list[NewRequest]


@dataclass(slots=True)
class AbortAll:
    """Abort every request in the engine; each sends its last delta."""


@dataclass(slots=True)
class TakeSnapshot:
    """The engine's stats and finish-reason counts, taken between two steps."""


@dataclass(slots=True)
class StepPage:
    since: float | None
    limit: int
    with_ids: bool


@dataclass(slots=True)
class StartProfile:
    """Open a torch.profiler window on the stepping thread."""


@dataclass(slots=True)
class StopProfile:
    directory: str               # where the trace and its summary are written


Command = AddRequests | AbortAll | TakeSnapshot | StepPage | StartProfile | StopProfile


@dataclass(slots=True)
class Call:
    call_id: int
    command: Command


# ---- fire and forget -------------------------------------------------------------------------------
@dataclass(slots=True)
class AbortRequests:
    request_ids: list[str]
    reason: str = "abort"        # "stop": the client found a stop string (counted as a stop, not an abort)


@dataclass(slots=True)
class Stop:
    pass


# ---- core -> client --------------------------------------------------------------------------------
@dataclass(slots=True)
class Ready:
    info: EngineInfo
    tokenizer: object            # a models.tokenizer.Tokenizer, or None


@dataclass(slots=True)
class LoadFailed:
    error: BaseException


@dataclass(slots=True)
class StepOutputs:
    deltas: list[RequestDelta]


@dataclass(slots=True)
class Reply:
    call_id: int
    value: object = None
    error: BaseException | None = None


@dataclass(slots=True)
class EngineDied:
    message: str
    traceback: str
