"""How an engine-core process ended, in words for the server log and /health."""

from __future__ import annotations

import signal


def describe_exit(exitcode: int | None) -> str:
    """``multiprocessing.Process.exitcode`` in words: a negative code is the signal that
    killed the process ("killed by SIGKILL"), a positive one its exit status."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


def death_report(reason: str, exitcode: int | None, traceback: str | None = None) -> str:
    """One log entry for an engine process that died: why (the child's own message when it sent
    one), how the process ended unless ``reason`` already says so, and the child's traceback."""
    how = describe_exit(exitcode)
    report = reason if how in reason else f"{reason} ({how})"
    return f"{report}\n{traceback.rstrip()}" if traceback else report
