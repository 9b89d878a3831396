"""The SQLite results store: one row per run (bench, compare or tune), one per measured point
(target x load point) with its summary, and the named metrics of each point for trends.

The schema is versioned with `PRAGMA user_version`; a database written by a newer flashlane is
refused rather than misread.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .metrics import extract

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    created_utc TEXT NOT NULL,
    model TEXT,
    workload TEXT,
    stack TEXT,
    output_dir TEXT,
    git_sha TEXT,
    argv TEXT,
    manifest TEXT NOT NULL,
    summary TEXT NOT NULL
);
CREATE TABLE points (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    target TEXT NOT NULL,
    label TEXT NOT NULL,
    summary TEXT NOT NULL
);
CREATE TABLE metrics (
    point_id INTEGER NOT NULL REFERENCES points(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    value REAL NOT NULL,
    ci_low REAL,
    ci_high REAL,
    PRIMARY KEY (point_id, name)
);
CREATE INDEX points_by_run ON points(run_id);
"""


def flashlane_home() -> Path:
    """$FLASHLANE_HOME, else ~/.flashlane: where studies and the results database live."""
    return Path(os.environ.get("FLASHLANE_HOME") or Path.home() / ".flashlane").expanduser()


def default_db_path() -> Path:
    return flashlane_home() / "results.db"


class SchemaError(RuntimeError):
    pass


@dataclass
class PointIn:
    """One measured point to record: which target (model / stack) at which load point."""
    target: str
    label: str
    summary: dict


@dataclass
class Point:
    id: int
    run_id: int
    target: str
    label: str
    metrics: dict[str, tuple[float, float | None, float | None]]
    summary: dict = field(repr=False, default_factory=dict)


@dataclass
class Run:
    id: int
    kind: str
    created_utc: str
    model: str | None
    workload: str | None
    stack: str | None
    output_dir: str | None
    manifest: dict = field(repr=False, default_factory=dict)
    summary: dict = field(repr=False, default_factory=dict)


class ResultsStore:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.execute("PRAGMA foreign_keys = ON")
        try:
            self._migrate()
        except BaseException:
            self.db.close()
            raise

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaError(
                f"{self.path}: results database schema version {version} is newer than this flashlane "
                f"understands ({SCHEMA_VERSION}); upgrade flashlane or pass another --results-db")
        if version == 0:
            tables = self.db.execute("SELECT count(*) FROM sqlite_master WHERE type='table'").fetchone()[0]
            if tables:
                raise SchemaError(f"{self.path}: not a flashlane results database (unversioned tables)")
            with self.db:
                self.db.executescript(SCHEMA)
                self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def record(self, kind: str, points: list[PointIn], manifest: dict, summary: dict | None = None,
               model: str | None = None, workload: str | None = None, stack: str | None = None,
               output_dir: str | None = None) -> int:
        """Store a run and its points; returns the run id."""
        if not points:
            raise ValueError("record: a run needs at least one measured point")
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        with self.db:
            cur = self.db.execute(
                "INSERT INTO runs (kind, created_utc, model, workload, stack, output_dir, git_sha, argv, "
                "manifest, summary) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (kind, created, model, workload, stack, output_dir, manifest.get("git_sha"),
                 json.dumps(manifest.get("argv")), _dumps(manifest), _dumps(summary or {})))
            run_id = cur.lastrowid
            for p in points:
                pid = self.db.execute("INSERT INTO points (run_id, target, label, summary) VALUES (?, ?, ?, ?)",
                                      (run_id, p.target, p.label, _dumps(p.summary))).lastrowid
                self.db.executemany(
                    "INSERT INTO metrics (point_id, name, value, ci_low, ci_high) VALUES (?, ?, ?, ?, ?)",
                    [(pid, name, *vals) for name, vals in extract(p.summary).items()])
        return run_id

    def runs(self, model: str | None = None, workload: str | None = None, stack: str | None = None,
             kind: str | None = None, limit: int | None = None) -> list[Run]:
        """Newest last. `stack` matches the run's stack or any of its points' targets."""
        where, args = [], []
        for col, val in (("model", model), ("workload", workload), ("kind", kind)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        if stack is not None:
            where.append("(stack = ? OR id IN (SELECT run_id FROM points WHERE target = ?))")
            args += [stack, stack]
        sql = "SELECT id, kind, created_utc, model, workload, stack, output_dir, manifest, summary FROM runs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC"
        if limit:
            sql += f" LIMIT {int(limit)}"
        rows = self.db.execute(sql, args).fetchall()
        return [Run(*r[:7], json.loads(r[7]), json.loads(r[8])) for r in reversed(rows)]

    def run(self, ref: str | int) -> Run:
        run_id = self.resolve(ref)
        return next(r for r in self.runs() if r.id == run_id)

    def resolve(self, ref: str | int) -> int:
        """A run id, `latest`, or `latest~N` (N runs before the latest)."""
        text = str(ref).strip()
        ids = [r[0] for r in self.db.execute("SELECT id FROM runs ORDER BY id DESC")]
        if text.startswith("latest"):
            back = text[len("latest"):]
            n = int(back[1:]) if back.startswith("~") and back[1:].isdigit() else (0 if not back else None)
            if n is None:
                raise ValueError(f"run: expected an id, 'latest' or 'latest~N', got {text!r}")
            if n >= len(ids):
                raise ValueError(f"run: {text!r}: the database has {len(ids)} run(s)")
            return ids[n]
        if not text.isdigit():
            raise ValueError(f"run: expected an id, 'latest' or 'latest~N', got {text!r}")
        if int(text) not in ids:
            raise ValueError(f"run: no run with id {text} in {self.path}")
        return int(text)

    def points(self, run_id: int, with_summary: bool = False) -> list[Point]:
        rows = self.db.execute("SELECT id, run_id, target, label, summary FROM points WHERE run_id = ? "
                               "ORDER BY id", (run_id,)).fetchall()
        out = []
        for pid, rid, target, label, summary in rows:
            ms = {n: (v, lo, hi) for n, v, lo, hi in self.db.execute(
                "SELECT name, value, ci_low, ci_high FROM metrics WHERE point_id = ?", (pid,))}
            out.append(Point(pid, rid, target, label, ms, json.loads(summary) if with_summary else {}))
        return out

    def trend(self, name: str, model: str | None = None, workload: str | None = None,
              stack: str | None = None, kind: str | None = None) -> list[tuple[Run, Point]]:
        """Every (run, point) with a value for metric `name`, oldest first."""
        out = []
        for r in self.runs(model=model, workload=workload, stack=stack, kind=kind):
            for p in self.points(r.id):
                if name in p.metrics and (stack is None or r.stack == stack or p.target == stack):
                    out.append((r, p))
        return out


def _dumps(obj) -> str:
    return json.dumps(obj, default=str)
