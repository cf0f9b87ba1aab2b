"""The kernel cache: the plans ``attnlab calibrate`` measured on this machine, as JSON on disk.

The file maps a key (CPU model, torch version, thread count, the native kernels' build, the
variables that hold torch's libraries to an instruction set where set, dtype, shape, rows
bucket, with a bias or not; a quantized weight's scheme before it) to the median
microseconds per call of each kernel measured for it, float and quantized in one file. A
load reads it and never adds to it. It is read from ``$ATTNLAB_CACHE_DIR/kernels.json`` (else
``~/.cache/attnlab/kernels.json``), never unpickled, and never trusted blindly: an entry that
is not a mapping from a known kernel name to a finite positive time is dropped with a warning
and the file is rewritten without it.
Writes are atomic (a temporary file, then ``os.replace``), so a reader never sees half a file.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from attnlab.durable import write_text_atomic

__all__ = ["cache_file", "cpu_model", "entry_key", "read_entries", "write_entries"]

# A cache of a few thousand shapes is well below this; a larger file is not ours.
_MAX_BYTES = 4 * 2**20
_VERSION = 8  # 2: timings on weights not in a cache; 3: blocks_gemv with up to 4 blocks a
# thread; 4: copies past twice the last-level cache; 5: the native GEMVs' row groups and 8-lane
# loop, the tile kernel's vector writes (faster kernels: the old choices are stale); 6: with or
# without a bias, as the module has one (BLAS runs x W^T and x W^T + b by different paths);
# 7: the native build and the libraries' instruction-set variables in the key; 8: written by
# `attnlab calibrate` only, quantized timings in the same file, 33+ timed at 512 rows
# The variables with which torch, MKL and oneDNN are held to an older instruction set: a
# timing taken under one setting says nothing of another.
_LIBRARY_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def cache_file() -> Path:
    """Where the measured plans live: ``$ATTNLAB_CACHE_DIR/kernels.json`` when the variable is set
    (and not empty), else ``~/.cache/attnlab/kernels.json``."""
    folder = os.environ.get("ATTNLAB_CACHE_DIR") or Path.home() / ".cache" / "attnlab"
    return Path(folder) / "kernels.json"


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name`` on Linux), else what
    ``platform`` says; timings measured on one CPU are never reused on another."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.lower().startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def entry_key(dtype: torch.dtype, out_features: int, in_features: int, bucket: str, *,
              bias: bool, build: str) -> str:
    """The cache key of one measurement: CPU model, torch version, thread count, the native
    kernels' ``build`` (``attnlab.kernels.native.build_id()``), the libraries' instruction-set
    variables where set, dtype, shape ``O x I``, rows bucket and whether a bias is added,
    readable in the file."""
    if not isinstance(bias, bool):
        raise TypeError(f"bias: expected a bool, got {bias!r}")
    if not isinstance(build, str) or not build:
        raise TypeError(f"build: expected the native build's id (a string), got {build!r}")
    held = [f"{name}={os.environ[name]}" for name in _LIBRARY_VARIABLES
            if os.environ.get(name, "").strip()]
    return " | ".join((
        cpu_model(), f"torch {torch.__version__}", f"{torch.get_num_threads()} threads",
        f"native {build}", *held, str(dtype).removeprefix("torch."),
        f"{out_features}x{in_features}", f"rows {bucket}", "bias" if bias else "no bias",
    ))


def read_entries(path: Path, known: Iterable[str]) -> dict[str, dict[str, float]]:
    """The valid entries of the cache file at ``path`` (none when it is missing). A file that
    is not our JSON, or entries that name an unknown kernel or hold a time that is not a
    finite positive number, are dropped with a warning and the file is rewritten without
    them."""
    try:
        if path.stat().st_size > _MAX_BYTES:
            raise ValueError(f"larger than {_MAX_BYTES} bytes")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, ValueError, RecursionError) as error:  # JSON or UTF-8 errors included
        return _rewritten(path, {}, f"kernel cache {path}: ignored ({error}); it is rewritten")
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return _rewritten(path, {}, f"kernel cache {path}: ignored (expected an object with "
                                    f"version {_VERSION}); it is rewritten")
    raw = data.get("entries")
    raw = raw if isinstance(raw, dict) else {}
    names = set(known)
    entries = {key: dict(value) for key, value in raw.items() if _valid(value, names)}
    if len(entries) != len(raw) or not isinstance(data.get("entries"), dict):
        return _rewritten(path, entries, f"kernel cache {path}: {len(raw) - len(entries)} "
                                         "invalid entries ignored; the file is rewritten")
    return entries


def write_entries(path: Path, entries: Mapping[str, Mapping[str, float]]) -> bool:
    """Write ``entries`` to ``path`` atomically (``attnlab.durable``); False (with a warning)
    when the folder is not writable, so that a calibration still ends, only without a plan."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"version": _VERSION, "entries": entries}, indent=1, sort_keys=True)
        write_text_atomic(path, text)
    except OSError as error:
        warnings.warn(f"kernel cache {path}: not written ({error})", stacklevel=3)
        return False
    return True


def _valid(value: object, names: set[str]) -> bool:
    """Whether ``value`` is a non-empty mapping of known kernel names to finite times > 0."""
    return isinstance(value, dict) and bool(value) and all(
        name in names and isinstance(us, (int, float)) and not isinstance(us, bool)
        and math.isfinite(us) and us > 0
        for name, us in value.items()
    )


def _rewritten(path: Path, entries: dict[str, dict[str, float]], message: str
               ) -> dict[str, dict[str, float]]:
    warnings.warn(message, stacklevel=3)
    write_entries(path, entries)
    return entries
