"""Terminal progress bar (rich): sessions done out of the target, requests and errors so far."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .records import PHASE_PROFILING


class ProgressView:
    def __init__(self, label: str, total_sessions: int | None, enabled: bool = True):
        self.enabled = enabled
        self.requests = self.errors = 0
        self.label = label
        if not enabled:
            return
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                 TimeElapsedColumn(), console=Console(file=sys.stderr),
                                 transient=False)
        self.task = self.progress.add_task(label, total=total_sessions, info="")

    def __enter__(self):
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.progress.stop()

    def on_event(self, kind: str, obj) -> None:
        if not self.enabled:
            return
        if kind == "request":
            self.requests += 1
            self.errors += 0 if obj.ok else 1
        elif kind == "session" and obj.phase == PHASE_PROFILING and not obj.truncated:
            self.progress.advance(self.task)
        self.progress.update(self.task, info=f"{self.requests} requests, {self.errors} errors")
