"""The machine description every measurement records beside its numbers."""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path

import torch

from .kernels.cpu_caps import detect_cpu_caps


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# the code a step's time depends on: the engine, the models and the kernels (their native sources too)
_ENGINE_CODE = ("engine", "models", "kernels")


def code_fingerprint(root: Path, parts: tuple[str, ...] = _ENGINE_CODE) -> str:
    """12 hex digits of sha256 over the .py/.cpp/.h files under ``root``'s ``parts`` (paths and
    contents, in sorted order; caches left out)."""
    digest = hashlib.sha256()
    for part in parts:
        for path in sorted((root / part).rglob("*")):
            if path.suffix in (".py", ".cpp", ".h") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def engine_code() -> str:
    """The fingerprint of this flashlane's engine, models and kernels: two measurements of step
    costs compare only when it is equal, whatever the package's version says."""
    return code_fingerprint(Path(__file__).parent)


def machine_info() -> dict:
    """What a measurement's numbers depend on, recorded beside them: CPU model, torch's vector
    capability and the flags flashlane's kernels choose by, threads, versions, accelerator, and
    the fingerprint of the engine's code."""
    return {"cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_features": detect_cpu_caps().describe(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "engine_code": engine_code()}
