"""Run manifest: everything needed to know what was measured."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from pathlib import Path


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def git_sha() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        r = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=5)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def host_info(gpus: list[str]) -> dict:
    return {"platform": platform.platform(), "python": sys.version.split()[0],
            "cpu_count": os.cpu_count(), "machine": platform.machine(), "gpus": gpus,
            "gpu_count": len(gpus)}


def harness_version() -> str:
    from flashlane import __version__
    return __version__
