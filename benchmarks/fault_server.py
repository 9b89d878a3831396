"""`flashlane serve` with the faults a benchmark cannot make for real on this machine.

    python benchmarks/fault_server.py serve --model M ...   (the `flashlane` command line)

The injections are installed when this module is imported, in the server process and in the
engine-core process alike.

Two injections, each only when its variable is set:
- ``FAULT_ROOT_PERMISSIONS=DIR``: under DIR, opening a file whose permission bits are all zero
  fails with EACCES, as it would for any user but root (benchmarks run as root here, and root
  reads everything).
- ``FAULT_DISK_CAP=BYTES:DIR``: renaming a finished file into DIR fails with ENOSPC once the
  files there would exceed BYTES: a full disk where no small tmpfs can be mounted.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path


def _under(path, root: str) -> bool:
    try:
        return os.path.realpath(os.fspath(path)).startswith(root + os.sep)
    except (TypeError, ValueError):
        return False


def _emulate_permissions(root: str) -> None:
    real_open = os.open

    def checked_open(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is None and _under(path, root):
            try:
                if os.stat(path).st_mode & 0o777 == 0:
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
            except FileNotFoundError:
                pass
        return real_open(path, flags, mode, dir_fd=dir_fd)

    os.open = checked_open


def _cap_disk(cap: int, root: str) -> None:
    real_replace = os.replace

    def capped_replace(src, dst, *args, **kw):
        if _under(dst, root):
            used = sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file() and f != Path(src))
            if used + os.stat(src).st_size > cap:
                os.unlink(src)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(dst))
        return real_replace(src, dst, *args, **kw)

    os.replace = capped_replace


def install() -> None:
    if root := os.environ.get("FAULT_ROOT_PERMISSIONS"):
        _emulate_permissions(os.path.realpath(root))
    if spec := os.environ.get("FAULT_DISK_CAP"):
        cap, _, root = spec.partition(":")
        _cap_disk(int(cap), os.path.realpath(root))


# at import, not under __main__: the engine-core process (multiprocessing spawn) imports this
# module as its main module, and the disk tier lives in that process
install()


def main() -> int:
    from flashlane.cli.main import main as flashlane_main

    return flashlane_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
