"""An ``EngineClient`` over either transport: the engine on a thread of this process, or in an
engine process of its own (supervised: restarted when it dies). Call ``start()`` on it to serve."""

from __future__ import annotations

import os

from .client import EngineClient
from .process_transport import ProcessTransport
from .restart_policy import DEFAULT_MAX_RESTARTS, DEFAULT_RESTART_BACKOFF_S
from .thread_transport import ThreadTransport


def engine_in_thread(model, **engine_args) -> EngineClient:
    """``model``: a preset name, checkpoint folder, .gguf path, or an already loaded model."""
    return EngineClient(ThreadTransport(model, **engine_args))


def engine_in_process(model: str | os.PathLike, *, max_restarts: int = DEFAULT_MAX_RESTARTS,
                      restart_backoff: float = DEFAULT_RESTART_BACKOFF_S, **engine_args) -> EngineClient:
    """The engine process loads ``model`` itself (a preset name, folder or .gguf path); load
    errors are raised here. ``max_restarts`` 0: a death is final."""
    return EngineClient(ProcessTransport(model, max_restarts=max_restarts, restart_backoff=restart_backoff,
                                         **engine_args))
