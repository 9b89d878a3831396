"""Kernel backends by name: registration and the start-up choice (engine arg ``kernel_backend``).

A backend is registered with a factory (device -> instance), a test of whether it can run on a
device (optionally with the reason it cannot, for the error of an explicit choice), and a priority; ``select_backend(device)`` ("auto") takes the available backend of the
highest priority, ties going to the earlier registration. One instance per (name, device) is
kept, so every batch of an engine carries the same object (a compiled graph sees one backend).

Adding a backend: a new folder beside ``cpu/`` with a ``KernelBackend`` subclass, plus one
``register_backend`` line below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base import KernelBackend, VarlenBatch
from .cpu import CpuBackend
from .cuda import CudaBackend, cuda_missing


@dataclass(frozen=True)
class _Entry:
    factory: Callable[[torch.device], KernelBackend]
    available: Callable[[torch.device], bool]
    priority: int
    why_not: Callable[[torch.device], str | None] | None = None


_REGISTRY: dict[str, _Entry] = {}
_INSTANCES: dict[tuple[str, str], KernelBackend] = {}


def register_backend(name: str, factory: Callable[[torch.device], KernelBackend],
                     available: Callable[[torch.device], bool], *, priority: int = 0,
                     why_not: Callable[[torch.device], str | None] | None = None) -> None:
    """Make ``name`` selectable; "auto" prefers higher ``priority`` among the available ones.
    ``why_not(device)``: what the backend lacks there, said when it is chosen by name but unavailable."""
    if not name or name == "auto":
        raise ValueError(f"a kernel backend cannot be called {name!r}")
    _REGISTRY[name] = _Entry(factory, available, priority, why_not)
    for key in [k for k in _INSTANCES if k[0] == name]:
        del _INSTANCES[key]


def known_backends() -> list[str]:
    return list(_REGISTRY)


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends that can run on ``device``, in the order "auto" would prefer them."""
    dev = torch.device(device)
    names = [n for n, e in _REGISTRY.items() if e.available(dev)]
    return sorted(names, key=lambda n: -_REGISTRY[n].priority)   # stable: registration order breaks ties


def select_backend(device: torch.device | str = "cpu", name: str | None = None) -> KernelBackend:
    """The backend called ``name`` for ``device`` ("auto" or None: the preferred available one).
    An unknown or unavailable name is a ValueError naming ``kernel_backend``."""
    dev = torch.device(device)
    usable = available_backends(dev)
    if name is None or name == "auto":
        if not usable:
            raise ValueError(f"kernel_backend auto: no kernel backend runs on device {dev} "
                             f"(known: {', '.join(known_backends()) or 'none'})")
        name = usable[0]
    elif name not in _REGISTRY:
        raise ValueError(f"kernel_backend {name!r} is not a known kernel backend "
                         f"(known: auto, {', '.join(known_backends())})")
    elif name not in usable:
        why_not = _REGISTRY[name].why_not
        reason = why_not(dev) if why_not is not None else None
        raise ValueError(f"kernel_backend {name!r} is not available on device {dev}"
                         f"{': ' + reason if reason else ''} "
                         f"(available there: auto, {', '.join(usable) or 'none'})")
    key = (name, str(dev))
    backend = _INSTANCES.get(key)
    if backend is None:
        backend = _INSTANCES[key] = _REGISTRY[name].factory(dev)
    return backend


# the plain-torch kernels run on every torch device: the fallback everywhere
register_backend("cpu", CpuBackend, lambda device: True)
# fla-core's KDA kernels where torch sees a GPU and fla imports (the optional extra "cuda")
register_backend("cuda", CudaBackend, lambda device: device.type == "cuda" and cuda_missing(device) is None,
                 priority=10, why_not=cuda_missing)

__all__ = ["KernelBackend", "VarlenBatch", "CpuBackend", "CudaBackend", "register_backend", "select_backend",
           "available_backends", "known_backends"]
