"""One training run per run folder: ``RunLock`` holds an exclusive ``flock`` on
``<folder>/run.lock`` while the run lasts.

A second run on the same folder is refused at once, naming the process that holds it (its
pid is written in the lock file), instead of both appending to ``metrics.jsonl`` and one
overwriting the other's ``last``. The kernel releases a ``flock`` when its process ends,
however it ends (even SIGKILL), so a crashed run never leaves the folder locked; the lock
file itself stays (removing it would let a third run lock a new file while the second still
holds the old one).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["LOCK_NAME", "RunFolderBusyError", "RunLock"]

LOCK_NAME = "run.lock"


class RunFolderBusyError(ValueError):
    """Another process holds the run folder's lock; ``pid`` is its id (None if unknown)."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


class RunLock:
    """Context manager: lock the run folder ``folder`` (made if missing) or raise
    ``RunFolderBusyError`` at once when another process holds it."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"process {holder}" if holder is not None else "another process"
            raise RunFolderBusyError(
                f"--out: {str(self.path.parent)!r} is in use by another training run "
                f"({who} holds {str(self.path)!r}); wait for it to end or choose another "
                "folder", holder) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def _read_pid(fd: int) -> int | None:
    """The pid written by the holder (None while it has not written it yet)."""
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    return int(text) if text.isdigit() else None
