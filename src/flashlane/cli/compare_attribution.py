"""What `flashlane compare` needs from outside bench (which speaks HTTP only): a model's role from
its config and the per-layer-type step profile from `flashlane profile`, run as a subprocess (the
simulation beside each side is `compare_simulation`)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from ..analyze import resolve_model
from ..bench.layer_profile import has_layer_table
from ..config import ConfigError


def role_of(model: str) -> str | None:
    """'hybrid' when the model's config has linear-attention (KDA) layers, 'standard' when it has
    none, None when no config can be read (a URL, an unknown name)."""
    try:
        cfg = resolve_model(model).cfg
    except (ConfigError, ValueError, OSError):
        return None
    return "hybrid" if "kda" in cfg.mixer_types else "standard"


def profile_available() -> bool:
    return importlib.util.find_spec("flashlane.cli.profile") is not None


def find_summary(folder: Path) -> dict | None:
    """The profile command's JSON summary in `folder`: the first JSON document with a layer table."""
    for f in sorted(folder.rglob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if has_layer_table(doc):
            return doc
    return None


def make_profiler(out_dir: Path, steps: int = 2, timeout_s: float = 300.0, log=print):
    """(model, batch, context) -> `flashlane profile` JSON summary; None when the command is not
    installed. A failed profile is logged and gives None (the comparison still stands)."""
    if not profile_available():
        return None

    def profile(model: str, batch: int, context: int, dtype: str | None = None) -> dict | None:
        if role_of(model) is None:  # no config to run it from (another server's model name)
            return None
        folder = Path(out_dir) / "profile" / Path(model).name
        cmd = [sys.executable, "-m", "flashlane.cli.main", "profile", model, "--batch", str(batch),
               "--context", str(context), "--steps", str(steps), "--output-dir", str(folder)]
        if dtype in ("float32", "bfloat16"):  # the weights' dtype the measured server ran
            cmd += ["--dtype", dtype]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except (subprocess.SubprocessError, OSError) as exc:
            log(f"profile of {model} failed: {exc}")
            return None
        if r.returncode != 0:
            log(f"profile of {model} failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
            return None
        return find_summary(folder)

    return profile
