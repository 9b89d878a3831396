"""Compile a kernel source of this folder into a shared library once per source, flags and
compiler, cached under ``$FLASHLANE_CACHE/kernels`` (default ``~/.cache/flashlane/kernels``), and
load it with ctypes."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
# no contraction of a separate multiply and add into one FMA: the kernels round where torch's
# elementwise ops round (FMAs are written out where they are meant)
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c++17", "-ffp-contract=off")
# kernels that split their rows over torch's OpenMP team (parallel.h)
OPENMP = ("-fopenmp",)
_OPENMP_RUNTIME = re.compile(r"/lib(gomp|iomp5|omp)[^/]*\.so")


class NativeUnavailable(RuntimeError):
    """A native kernel cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    root = os.environ.get("FLASHLANE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "flashlane")
    return Path(root) / "kernels"


def compiler() -> str:
    """``$CXX``, else the first of c++ / g++ / clang++ on PATH (NativeUnavailable if none)."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    raise NativeUnavailable("no C++ compiler found (set CXX, or install g++)")


def why_unavailable(cpu_reason: str | None, bind: Callable[[], object]) -> str | None:
    """``cpu_reason`` if the CPU cannot run a kernel, else why ``bind()`` (building, loading and
    typing a library's functions) fails; None when it works."""
    if cpu_reason is not None:
        return cpu_reason
    try:
        bind()
    except NativeUnavailable as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=None)
def load(name: str, arch_flags: tuple[str, ...]) -> ctypes.CDLL:
    """``name``.cpp built with ``arch_flags`` (e.g. ``("-mavx2", "-mfma")``), loaded. Where the
    compiler cannot build it with ``OPENMP``, it is built without: ``parallel.h`` then runs every
    part on the calling thread."""
    try:
        return _load(name, arch_flags)
    except NativeUnavailable:
        if not set(OPENMP) & set(arch_flags):
            raise
        return _load(name, tuple(f for f in arch_flags if f not in OPENMP))


def _load(name: str, arch_flags: tuple[str, ...]) -> ctypes.CDLL:
    source = HERE / f"{name}.cpp"
    cxx = compiler()
    flags = (*FLAGS, *arch_flags)
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{cxx} --version failed: {exc}") from exc
    # every source of the folder: a kernel may include its neighbours (simd.h, row_gemm.cpp, ...)
    sources = sorted((*HERE.glob("*.cpp"), *HERE.glob("*.h")))
    texts = [f"{p.name}\0{p.read_text()}" for p in sources]
    key = hashlib.sha256("\0".join((source.name, *texts, *flags, version)).encode()).hexdigest()[:16]
    lib = cache_dir() / f"{name}-{key}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)   # built aside, renamed in place:
        os.close(fd)                                                 # concurrent starts never see half a file
        try:
            done = subprocess.run([cxx, *flags, str(source), "-o", tmp], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode:
                raise NativeUnavailable(f"{cxx} could not build {source.name}: "
                                        f"{(done.stderr or done.stdout).strip().splitlines()[:3]}")
            os.replace(tmp, lib)
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeUnavailable(f"building {source.name} with {cxx} failed: {exc}") from exc
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(lib))
    except OSError as exc:
        raise NativeUnavailable(f"cannot load {lib}: {exc}") from exc


def openmp_runtimes() -> set[str]:
    """The OpenMP runtime libraries mapped into this process (read from /proc; empty elsewhere).
    One is torch's; a kernel built with ``OPENMP`` must have found that same one (libgomp.so.1 is
    resolved to the library already loaded), else it would run a second team beside torch's."""
    try:
        with open("/proc/self/maps") as maps:
            return {os.path.realpath(line.split()[-1]) for line in maps if _OPENMP_RUNTIME.search(line)}
    except OSError:
        return set()
