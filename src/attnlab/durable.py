"""Writes that survive a crash (a kill, a power cut) at any moment.

A folder ``name`` is replaced in three renames: the new version is written and fsync'd in a
hidden ``.name.tmp-*`` folder, the current ``name`` becomes ``.name.old``, the new one becomes
``name``, and only then is ``.name.old`` removed. At every moment a complete copy exists:
``name`` itself or, after a crash between the two renames, ``.name.old``, which
``existing_folder`` finds. Leftovers of killed writers are removed by the next write.

What is written gets the modes that the user's umask gives a plain ``mkdir`` or ``open``
(0755 folders and 0644 files under the usual 022): ``mkdtemp`` makes 0700 folders and
safetensors writes 0600 files, both meant for private temporary files, not for a
checkpoint or a model that other users or a server account may need to read.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["existing_folder", "fsync_path", "new_folder", "swap_in", "umask_mode",
           "write_file_atomic", "write_text_atomic"]


def new_folder(target: Path) -> Path:
    """An empty hidden folder beside ``target`` to write its next version into (leftover
    ``.tmp-*`` folders of ``target`` from killed writers are removed first)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{glob.escape(target.name)}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    folder.chmod(umask_mode(0o777))
    return folder


def swap_in(new: Path, target: Path) -> None:
    """Make the complete folder ``new`` (from ``new_folder``) the one at ``target``; its
    files get the umask's mode (module docstring)."""
    file_mode = umask_mode(0o666)
    for path in new.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(file_mode)
        fsync_path(path)
    fsync_path(new)
    old = _old(target)
    if target.exists():
        # ``target`` is complete whenever it exists, so an ``.old`` beside it is a leftover.
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        fsync_path(target.parent)
    os.replace(new, target)
    fsync_path(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def existing_folder(target: Path) -> Path | None:
    """The complete copy of folder ``target``: itself, or ``.target.old`` when a crash came
    between the two renames of ``swap_in``; None when there is neither."""
    if target.is_dir():
        return target
    old = _old(target)
    return old if old.is_dir() else None


def write_text_atomic(path: Path, text: str) -> None:
    """Replace the file ``path`` by ``text`` in one step (``write_file_atomic``)."""
    write_file_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_file_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Replace the file ``path`` in one step: ``write(tmp)`` writes a temporary file beside
    it, which is fsync'd and renamed over ``path``; a crash at any moment leaves the old file
    or the new one, never a part. Leftover temporary files of killed writers are removed
    first."""
    for stale in path.parent.glob(f".{glob.escape(path.name)}.tmp-*"):
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        tmp.chmod(umask_mode(0o666))
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's contents (a folder: its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask_mode(mode: int) -> int:
    """``mode`` (0o777 for a folder, 0o666 for a file) less the process's umask: what
    ``mkdir`` or ``open`` would give. Read from ``/proc/self/status`` where it exists, since
    reading it with ``os.umask`` means setting it for a moment, for every thread."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return mode & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mode & ~mask


def _old(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")
