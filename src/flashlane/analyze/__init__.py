"""Analytic cost model of a model config: parameters, cache, FLOPs, memory, roofline, claims.

Torch-free on purpose (it reads configs only); ``flashlane analyze`` is its command line.
"""

from .cache import KV_FORMATS, CacheBytes, cache_bytes
from .flops import TokenFlops, decode_flops, prefill_flops
from .hardware import HARDWARE, Hardware, get_hardware
from .memory import Layout, device_memory
from .models import NamedConfig, resolve_model
from .params import ParamCounts, count_params
from .report import Options, build_report
from .text import render_text
from .roofline import Roofline, Setup
from .task import TaskProfile, load_task

__all__ = [
    "HARDWARE", "KV_FORMATS", "CacheBytes", "Hardware", "Layout", "NamedConfig", "Options", "ParamCounts",
    "Roofline", "Setup", "TaskProfile", "TokenFlops", "build_report", "cache_bytes", "count_params",
    "decode_flops", "device_memory", "get_hardware", "load_task", "prefill_flops", "render_text",
    "resolve_model",
]
