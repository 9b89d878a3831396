"""Register a finished bench / compare / tune run in the results store (--results-db, --no-record)."""

from __future__ import annotations

import sqlite3
import sys


def record_results(args, kind: str, out_dir, targets=None) -> int | None:
    """Record the run under `out_dir`; returns its id, or None when --no-record or nothing to record.
    A store that cannot be written is reported, never fatal: the run's own files are the results."""
    if getattr(args, "no_record", False):
        return None
    from flashlane.results.record import record_run
    from flashlane.results.store import SchemaError, default_db_path

    db = getattr(args, "results_db", None) or default_db_path()
    try:
        run_id = record_run(db, kind, out_dir, targets=targets, argv=list(sys.argv))
    except (SchemaError, ValueError, OSError, sqlite3.Error) as e:
        print(f"flashlane {kind}: not recorded in {db}: {e}", file=sys.stderr)
        return None
    print(f"recorded as run {run_id} in {db}", file=sys.stderr)
    return run_id
