"""What a caller of a serving engine may have to handle besides bad input (``InvalidRequest``)."""


class EngineDeadError(RuntimeError):
    """The engine is not running (its step crashed, its process died, or it was shut down)."""
