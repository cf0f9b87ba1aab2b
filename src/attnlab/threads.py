"""Threads are the user's to set: the ``--threads N`` option that every long-running
``attnlab`` command takes, its default, and the note that a busy machine wants fewer.

``add_threads_option(parser)`` adds the option; ``use_threads(args.threads, ...)`` applies it
before any work. The count, in order of precedence:

1. ``--threads N``;
2. ``$ATTNLAB_NUM_THREADS``;
3. ``$OMP_NUM_THREADS`` when it holds a positive int (torch reads it at start; ``torchrun``
   sets it to 1 for several processes on one machine, so that they do not share the cores
   ``N`` times over);
4. the CPUs this process may use (``os.sched_getaffinity``, else ``os.cpu_count()``).

Why it matters: torch's OpenMP threads spin at every barrier until all of them arrive. When
another program holds a core, the thread that waits for it spins instead of working, so on a
busy machine more threads than free cores run slower than fewer (the ``- load average`` and
``spread of repeats`` lines of a benchmark's table record such a run). So a command that
picked the count itself (none of the three was set) and finds the 1-minute load average above
the usable CPUs says so on stderr once and suggests ``--threads 1``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

from attnlab.arg_types import positive_int

__all__ = [
    "ENV",
    "add_threads_option",
    "busy_note",
    "default_threads",
    "load_average",
    "usable_cpus",
    "use_threads",
]

ENV = "ATTNLAB_NUM_THREADS"
HELP = (f"torch threads (default: ${ENV} if set, else $OMP_NUM_THREADS, else the CPUs this "
        "process may use); on a machine busy with other work, 1 is often fastest")


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--threads N`` (a positive int; ``None`` when not given) to ``parser``."""
    parser.add_argument("--threads", type=positive_int, default=None, metavar="N", help=HELP)


def use_threads(given: int | None, *, note_when_busy: bool = False) -> int:
    """Set torch's thread count to ``given`` (``--threads``), or to ``default_threads()``
    when it is ``None``, and return it. Inter-op threads are set to the same count where
    torch still allows it (before any inter-op work, once per process).

    With ``note_when_busy``, when no one chose the count (no ``--threads``, neither
    environment variable) and ``busy_note`` finds the machine busy, print its line on
    stderr."""
    from_environment = None if given is not None else _environment_threads()
    threads = given or from_environment or usable_cpus()
    torch.set_num_threads(threads)
    # Refused once set, or once inter-op work has started: torch then keeps its count.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(threads)
    if note_when_busy and given is None and from_environment is None:
        note = busy_note(threads)
        if note:
            print(note, file=sys.stderr, flush=True)
    return threads


def default_threads() -> int:
    """The count when ``--threads`` is not given (module docstring); a ``ValueError`` naming
    ``ATTNLAB_NUM_THREADS`` when it holds anything but a positive int."""
    return _environment_threads() or usable_cpus()


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a container's or ``taskset``'s
    limit), else every CPU of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average (runnable and waiting processes), or ``None`` where the
    system does not say."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy_note(threads: int) -> str | None:
    """The stderr line when the 1-minute load average exceeds the usable CPUs and ``threads``
    is more than 1; ``None`` otherwise."""
    load, cpus = load_average(), usable_cpus()
    if load is None or load <= cpus or threads <= 1:
        return None
    return (f"attnlab: the machine is busy (load {load:.1f} on {cpus} CPUs): with --threads 1 "
            f"this may run several times faster than with {threads} (OpenMP threads spin at "
            "barriers when a core is taken)")


def _environment_threads() -> int | None:
    """``ATTNLAB_NUM_THREADS`` (refused unless a positive int), else ``OMP_NUM_THREADS`` when
    it holds a positive int (torch itself ignores any other value), else ``None``."""
    ours = os.environ.get(ENV, "").strip()
    if ours:
        try:
            return positive_int(ours)
        except argparse.ArgumentTypeError:
            raise ValueError(f"{ENV}: expected a positive int (torch threads), "
                             f"got {ours!r}") from None
    try:
        return positive_int(os.environ.get("OMP_NUM_THREADS", "").strip())
    except argparse.ArgumentTypeError:
        return None
