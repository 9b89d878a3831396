"""The ``cpu`` kernel backend: the plain-torch kernels of ``flashlane.kernels``."""

from .backend import CpuBackend

__all__ = ["CpuBackend"]
