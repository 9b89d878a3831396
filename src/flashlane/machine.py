"""The machine description every measurement records beside its numbers."""

from __future__ import annotations

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


def machine_info() -> dict:
    """What a measurement's numbers depend on, recorded beside them: CPU model, torch's vector
    capability and the flags flashlane's kernels choose by, threads, versions, accelerator."""
    return {"cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_features": detect_cpu_caps().describe(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
