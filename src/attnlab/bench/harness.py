"""Timing and memory measurement shared by the benchmarks.

Times are medians of repeats after a warm-up. Peak memory is the extra memory a call needs
beyond what exists before it: ``torch.cuda.max_memory_allocated`` on CUDA, and on CPU the
peak resident set size (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``) with
glibc told to return freed blocks to the system, so that a reused heap does not hide usage.
Out-of-memory is a result (``"OOM"``), not a crash.

A run records the machine it measured on (``machine_info``): besides the hardware, the
1-minute load average at its start (``begin_run``, which ``attnlab bench`` calls) and at its
end, and the spread of each timed figure's repeats, ``(max - min) / median``. The table says
in a warning line (``machine_section``) when the machine was busy (a load above the CPUs the
process may use) or the repeats disagree (a spread above ``SPREAD_LIMIT``): such figures
measure the other work as much as the code.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from attnlab._checks import check_positive
from attnlab.allocator import glibc, return_free_pages
from attnlab.threads import load_average, usable_cpus

__all__ = [
    "SPREAD_LIMIT",
    "BandwidthProbe",
    "Measurement",
    "available_memory",
    "begin_run",
    "device_arg",
    "int_list",
    "machine_info",
    "machine_section",
    "oom_as_error",
    "peak_memory",
    "time_median",
    "time_medians",
]

# Repeats whose (max - min) / median exceeds this disagree: their median is not one figure.
SPREAD_LIMIT = 0.10


@dataclass(frozen=True)
class Measurement:
    """One benchmark cell: median seconds and extra peak bytes, or why there is none."""

    seconds: float | None
    peak_bytes: int | None
    error: str | None = None

    def time_ms(self) -> str:
        return self.error or f"{self.seconds * 1e3:.2f}"

    def memory_mib(self) -> str:
        if self.error:
            return self.error
        return "n/a" if self.peak_bytes is None else f"{self.peak_bytes / 2**20:.1f}"


def time_median(
    fn: Callable[[], object],
    *,
    repeats: int = 5,
    warmup: int = 1,
    budget_s: float = 20.0,
    device: torch.device | None = None,
) -> float:
    """Median wall time of ``fn()`` over at most ``repeats`` runs (at least 3 if ``repeats``
    allows).

    Stops adding runs once ``budget_s`` seconds are spent (after the third).
    """
    return time_medians(
        {"fn": fn}, repeats=repeats, warmup=warmup, budget_s=budget_s, device=device
    )["fn"]


def time_medians(
    fns: dict[str, Callable[[], object]],
    *,
    repeats: int = 5,
    warmup: int = 1,
    budget_s: float = 20.0,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Median wall time of each function, timed in turns: one run of each per round.

    Interleaving makes a machine that speeds up or slows down during the measurement weigh
    on every function alike, so their ratios hold better than from back-to-back medians; the
    order turns each round. At most ``repeats`` rounds (at least 3 if it allows); no more once
    ``budget_s`` seconds per function are spent (after the third).
    """
    check_positive("repeats", repeats)
    if not fns:
        return {}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            _sync(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    start = time.perf_counter()
    for done in range(1, repeats + 1):
        # The order turns each round, so that no function always runs after the same one.
        turn = (done - 1) % len(names)
        for name in names[turn:] + names[:turn]:
            fn = fns[name]
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
        if done >= 3 and time.perf_counter() - start > budget_s * len(fns):
            break
    for t in times.values():
        _run.note_repeats(t)
    return {name: statistics.median(t) for name, t in times.items()}


def begin_run() -> None:
    """Start recording a benchmark run: the 1-minute load average now, and from now on the
    spread of every figure that ``time_medians`` times; ``machine_info`` reports both. Until
    it is first called, the run began when this module was imported."""
    global _run
    _run = _Run(load_average())


class BandwidthProbe:
    """Memory read bandwidth: ``sum`` over a float32 buffer of ``numel`` elements (1 GiB by
    default, well past the caches). Calling it reads the buffer once: time it in turns with
    what it bounds (``time_medians``), so that both see the machine of the same moments;
    ``gbs(seconds)`` turns such a time into GB/s."""

    def __init__(self, numel: int = 2**28, device: torch.device | None = None) -> None:
        check_positive("numel", numel)
        self.buffer = torch.ones(numel, device=device)

    def __call__(self) -> torch.Tensor:
        return self.buffer.sum()

    def gbs(self, seconds: float) -> float:
        """GB/s of one call that took ``seconds``."""
        return self.buffer.numel() * 4 / seconds / 1e9


def peak_memory(fn: Callable[[], object], device: torch.device | None = None) -> int | None:
    """Extra bytes at the peak of ``fn()`` over the memory in use before it (None if unknown)."""
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    if not _cpu_peak_supported():
        return None
    libc = glibc()
    if libc is not None:
        # Freed blocks go back to the system during the measurement, so that a reused heap
        # does not hide usage...
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 * 1024)
        return_free_pages()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS")
        fn()
        return max(0, (_status_kib("VmHWM") - before) * 1024)
    finally:
        if libc is not None:
            # ...and only then: mapping every mid-size block afresh would slow the timed runs
            # (the caps are the largest glibc's own dynamic thresholds reach).
            libc.mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
            libc.mallopt(_M_TRIM_THRESHOLD, 64 * 2**20)


def available_memory(device: torch.device | None = None) -> int:
    """Bytes that can still be allocated on ``device`` (CPU: ``MemAvailable``)."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def machine_info(device: torch.device | None = None) -> dict[str, str]:
    """What the figures were measured on (and when), saved beside them."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "memory": f"{_total_memory() / 2**30:.1f} GiB",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu capability": torch.backends.cpu.get_cpu_capability(),
    }
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info.update(_run.conditions(load_average(), usable_cpus()))
    info["measured"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return info


def machine_section(info: dict[str, str]) -> list[str]:
    """The markdown lines that record the machine beside a benchmark's table; its
    ``warning``, when it has one, first and set apart."""
    warning = [f"> **Warning:** {info['warning']}", ""] if info.get("warning") else []
    return ["", "## Machine", "", *warning,
            *[f"- {k}: {v}" for k, v in info.items() if k != "warning"], ""]


def int_list(text: str) -> tuple[int, ...]:
    """``argparse`` type for comma-separated positive ints (``"256,1024"``)."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def device_arg(text: str) -> torch.device:
    """``argparse`` type for a device that this machine has (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"expected a device such as cpu or cuda, got {text!r}"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available on this machine")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    return device


T = TypeVar("T")


def oom_as_error(fn: Callable[[], T]) -> tuple[T | None, str | None]:
    """``(fn(), None)``, or ``(None, "OOM")`` when ``fn`` runs out of memory: out-of-memory
    is a result; any other error propagates."""
    try:
        return fn(), None
    except (RuntimeError, MemoryError) as error:
        if not is_oom(error):
            raise
        return None, "OOM"


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure (CPU or CUDA)."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(error).lower()
    return "out of memory" in text or "can't allocate memory" in text


@dataclass
class _Run:
    """What one benchmark run saw of the machine: the load at its start, and the spread
    ``(max - min) / median`` of each figure's timed repeats (a figure timed once has none)."""

    load_start: float | None
    spreads: list[float] = field(default_factory=list)

    def note_repeats(self, times: list[float]) -> None:
        median = statistics.median(times)
        if len(times) >= 2 and median > 0:
            self.spreads.append((max(times) - min(times)) / median)

    def conditions(self, load_end: float | None, cpus: int) -> dict[str, str]:
        """``machine_info``'s entries for the run, ending now with ``load_end``: the load,
        the repeats' spread and, when the machine was busy or the repeats disagree, a
        ``warning``."""
        loads = [x for x in (self.load_start, load_end) if x is not None]
        entries = {"usable cpus": str(cpus), "load average (1 min)": (
            f"{_load(self.load_start)} at start, {_load(load_end)} at end")}
        if self.spreads:
            over = sum(x > SPREAD_LIMIT for x in self.spreads)
            entries["spread of repeats"] = (
                f"median {statistics.median(self.spreads):.1%}, worst {max(self.spreads):.1%}; "
                f"{over} of {len(self.spreads)} figures over {SPREAD_LIMIT:.0%} "
                "((max - min) / median of each figure's timed repeats)")
        why = []
        if loads and max(loads) > cpus:
            why.append(f"the machine was busy (load {max(loads):.1f} on {cpus} usable CPUs)")
        if self.spreads and max(self.spreads) > SPREAD_LIMIT:
            why.append(f"the repeats disagree (spread up to {max(self.spreads):.0%}, over "
                       f"{SPREAD_LIMIT:.0%})")
        if why:
            entries["warning"] = (" and ".join(why) + ": these figures may measure other "
                                  "work as much as this code; measure again on a quiet machine")
        return entries


def _load(load: float | None) -> str:
    return "unknown" if load is None else f"{load:.2f}"


# The run being recorded; ``begin_run`` starts a new one.
_run = _Run(load_average())


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_peak_supported() -> bool:
    return os.access("/proc/self/clear_refs", os.W_OK) and os.path.exists("/proc/self/status")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
