"""The ``cuda`` kernel backend: KDA through flash-linear-attention's Triton kernels (the optional
``fla-core`` package, ``pip install 'flashlane[cuda]'``), every other op the plain-torch one."""

from .backend import PIP_EXTRA, CudaBackend, cuda_missing, fla_version

__all__ = ["CudaBackend", "PIP_EXTRA", "cuda_missing", "fla_version"]
