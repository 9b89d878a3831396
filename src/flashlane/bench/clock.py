"""The one monotonic clock every bench timestamp is taken on."""

import time


def now() -> float:
    """Seconds on a monotonic, high-resolution clock shared by client records and telemetry."""
    return time.perf_counter()
