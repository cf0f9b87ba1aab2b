"""Choosing a kernel by measuring: which of :data:`~attnlab.kernels.catalog.KERNELS` computes
``x W^T + b`` fastest for a dtype, a shape ``O x I`` and a row count, on this machine.

Rows come in buckets (``1`` for one-sequence decoding, ``2-8`` for batched decoding, ``9-32``
for a serving engine's batch of decoding requests, ``33+`` for prefill), each measured at one
representative row count (16 for ``9-32``: the batch a server decodes, where oneDNN's
packed weights win; a 64-row batch ranks the kernels like prefill). A
measurement times every candidate kernel on random data under ``torch.inference_mode()``,
a few interleaved repeats each (median, a few milliseconds per candidate for decoder
shapes), after checking its result against the formula's; the timings are cached on disk
(:mod:`attnlab.kernels.cache`). ``ATTNLAB_KERNELS=<name>`` (or a ``kernel`` argument) skips
the measuring and forces one kernel everywhere.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import statistics
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor

from attnlab._checks import check_positive
from attnlab.kernels import cache, native
from attnlab.kernels.catalog import KERNELS, LAYOUTS

__all__ = [
    "BUCKETS",
    "bucket_of",
    "choose",
    "cold_copies",
    "forced_kernel",
    "measure",
    "measure_rows",
    "plan",
]

# name -> (smallest row count, representative row count measured for it)
BUCKETS: dict[str, tuple[int, int]] = {"1": (1, 1), "2-8": (2, 8), "9-32": (9, 16),
                                       "33+": (33, 128)}
_ENV = "ATTNLAB_KERNELS"
_MIN_REPEATS, _MAX_REPEATS = 3, 9
_BUDGET_US = 10_000  # per candidate, once it has _MIN_REPEATS timings
_HOPELESS = 10  # times the fastest warm-up call: not worth repeating
_MARGIN = 1.1  # how much faster than the formula (or row-major plan) a choice must measure
# In a model each weight is read once per token from memory, not from a cache that the last
# call warmed: timings cycle through copies of the weight that together exceed the caches
# (twice the last-level cache, at least _COLD_BYTES; a CPU may report 480 MB of L3). The
# copies' creation is what flushes the first ones read, so small weights need many.
_COLD_BYTES, _MAX_COLD_BYTES, _MAX_COPIES = 128 * 2**20, 2 * 2**30, 4096
# Timings read from or written to the cache file in this process, by cache key.
_TIMINGS: dict[str, dict[str, float]] = {}


def choose(dtype: torch.dtype, out_features: int, in_features: int, rows_bucket: str, *,
           kernels: Iterable[str] | None = None, kernel: str | None = None,
           bias: bool = True) -> str:
    """The fastest kernel for ``x (M x I) W^T (I x O)`` (``+ b`` when ``bias``) in ``dtype``
    with ``M`` in ``rows_bucket``: measured once on this machine (among ``kernels``, default
    all), then read from the cache. ``kernel`` (or ``$ATTNLAB_KERNELS``) forces one instead; a
    forced kernel that cannot run this dtype gives ``"formula"``."""
    forced = forced_kernel(kernel)
    if forced is not None:
        lowest = BUCKETS[_check_bucket(rows_bucket)][0]
        return forced if KERNELS[forced].available(dtype, lowest, out_features) else "formula"
    timings = measure(dtype, out_features, in_features, rows_bucket, kernels, bias=bias)
    return min(timings, key=timings.__getitem__)


def plan(dtype: torch.dtype, out_features: int, in_features: int, *,
         layouts: Sequence[str] = ("rows", "columns"), extra_memory: bool = False,
         kernel: str | None = None, bias: bool = True) -> tuple[str, dict[str, str]]:
    """One weight's storage and its kernel per rows bucket: ``(layout, {bucket: kernel})``,
    for a module that adds a bias or not (``bias``: timed as it will run).

    A weight is stored once, in one of ``layouts``, so every bucket must use a kernel that
    runs on that storage (with ``extra_memory``, oneDNN's packed copy beside it is allowed
    too). A layout is a candidate only if its kernel is, in every bucket, no slower than the
    formula (what ``nn.Linear`` runs): a faster one-row decode must not cost a slower
    batched decode or prefill. Among the candidates, the one that loses least against each
    bucket's fastest kernel, summed over the buckets (``sum_b t_layout(b) / t_best(b)``);
    the first of ``layouts`` unless another is better by ``_MARGIN`` (10%), and within a
    layout the formula unless a kernel beats it by that much; with no candidate, the
    formula. A forced ``kernel`` (or ``$ATTNLAB_KERNELS``) is used for every bucket.
    """
    for layout in layouts:
        if layout not in LAYOUTS[:2]:
            raise ValueError(f"layouts: expected 'rows' or 'columns', got {layout!r}")
    forced = forced_kernel(kernel)
    if forced is not None:
        picks = {b: choose(dtype, out_features, in_features, b, kernel=forced) for b in BUCKETS}
        layout = KERNELS[forced].layout if forced in picks.values() else "rows"
        return ("rows" if layout == "packed" else layout), picks
    allowed = {*layouts, "packed"} if extra_memory else set(layouts)
    candidates = [name for name, k in KERNELS.items() if k.layout in allowed]
    timings = {b: measure(dtype, out_features, in_features, b, candidates, bias=bias)
               for b in BUCKETS}
    best = {b: min(t.values()) for b, t in timings.items()}
    options = {}
    for layout in layouts:
        usable = {layout, "packed"} if extra_memory else {layout}
        fits = {b: [n for n in t if KERNELS[n].layout in usable] for b, t in timings.items()}
        if not all(fits.values()):
            continue
        picks = {b: _pick(names, timings[b]) for b, names in fits.items()}
        if all(timings[b][n] <= timings[b]["formula"] for b, n in picks.items()):
            options[layout] = (sum(timings[b][n] / best[b] for b, n in picks.items()), picks)
    if not options:  # no layout keeps up with the formula everywhere: the formula itself
        return "rows", dict.fromkeys(BUCKETS, "formula")
    layout = min(options, key=lambda name: options[name][0])
    first = layouts[0]
    if first in options and options[first][0] <= _MARGIN * options[layout][0]:
        layout = first  # re-storing every weight is worth it only for a clear gain
    return layout, options[layout][1]


def measure(dtype: torch.dtype, out_features: int, in_features: int, rows_bucket: str,
            kernels: Iterable[str] | None = None, *, bias: bool = True) -> dict[str, float]:
    """Median microseconds per call of each of ``kernels`` (default all) that can run, at the
    bucket's representative row count, with a bias or not (``bias``): from the cache when it
    holds them, else measured now and added to it. At least ``"formula"`` is always there."""
    names = _check_names("kernels", KERNELS if kernels is None else kernels)
    rows = BUCKETS[_check_bucket(rows_bucket)][1]
    names = [n for n in dict.fromkeys(("formula", *names))
             if KERNELS[n].available(dtype, rows, out_features)]
    key = cache.entry_key(dtype, out_features, in_features, rows_bucket, bias=bias,
                          build=native.build_id())
    path = cache.cache_file()
    if key not in _TIMINGS:
        stored = cache.read_entries(path, KERNELS).get(key)
        _TIMINGS[key] = dict(stored) if stored else {}
    missing = [n for n in names if n not in _TIMINGS[key]]
    if missing:
        measured = measure_rows(dtype, out_features, in_features, rows, missing, bias=bias)
        # A kernel left out (it raised or was wrong) is not tried again in this process.
        _TIMINGS[key].update({n: measured.get(n, math.inf) for n in missing})
        entries = cache.read_entries(path, KERNELS)
        entries[key] = {n: t for n, t in _TIMINGS[key].items() if math.isfinite(t)}
        cache.write_entries(path, entries)
    return {n: _TIMINGS[key][n] for n in names if math.isfinite(_TIMINGS[key][n])}


def measure_rows(dtype: torch.dtype, out_features: int, in_features: int, rows: int,
                 kernels: Iterable[str] | None = None, *, bias: bool = True
                 ) -> dict[str, float]:
    """Median microseconds per call of each of ``kernels`` (default all) that can run
    ``x (rows x I) W^T + b`` (without ``+ b`` unless ``bias``: BLAS may take another path)
    in ``dtype`` here, timed now (not cached): kernels that share a weight layout are timed
    in interleaved rounds, so a burst of load on a shared machine hits them alike, and only
    one prepared copy of the weight exists at a time. A kernel whose result differs from the
    formula's, or that raises, is left out with a warning."""
    names = _check_names("kernels", KERNELS if kernels is None else kernels)
    for name, value in (("out_features", out_features), ("in_features", in_features),
                        ("rows", rows)):
        check_positive(name, value)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype: expected a floating-point torch.dtype, got {dtype!r}")
    if not isinstance(bias, bool):
        raise TypeError(f"bias: expected a bool, got {bias!r}")
    names = [n for n in names if KERNELS[n].available(dtype, rows, out_features)]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        weight = (torch.randn(out_features, in_features, generator=g) / in_features**0.5)
        weight = weight.to(dtype)
        x, b = (torch.randn(n, generator=g).to(dtype) for n in ((rows, in_features),
                                                               (out_features,)))
        b = b if bias else None
        expected = KERNELS["formula"].run(x, weight, b)
        timings: dict[str, float] = {}
        count = cold_copies(weight.numel() * weight.element_size())
        for layout in dict.fromkeys(KERNELS[n].layout for n in names):
            group = [n for n in names if KERNELS[n].layout == layout]
            copies = [KERNELS[group[0]].prepare(weight.clone() if i else weight)
                      for i in range(count)]
            timings.update(_time_group(group, x, copies, b, expected,
                                       min(timings.values(), default=math.inf)))
            del copies
    return timings


def cold_copies(bytes_each: int) -> int:
    """How many copies of a ``bytes_each`` weight a timing cycles through so that none is
    still cached when it is read again: ``ceil(max(2 x last-level cache, 128 MiB) /
    bytes_each)``, at most 4096 copies and 2 GiB in all (and at least one copy)."""
    check_positive("bytes_each", bytes_each)
    cold = min(_MAX_COLD_BYTES, max(_COLD_BYTES, 2 * _last_level_cache_bytes()))
    return max(1, min(-(-cold // bytes_each), _MAX_COPIES))


def forced_kernel(kernel: str | None = None) -> str | None:
    """The kernel forced for every call: ``kernel`` when given, else ``$ATTNLAB_KERNELS``
    when set and not empty, else None (measure)."""
    source, name = ("kernel", kernel) if kernel is not None else (_ENV, os.environ.get(_ENV))
    if name is None or (source == _ENV and not name.strip()):
        return None
    if not isinstance(name, str) or name.strip() not in KERNELS:
        raise ValueError(f"{source}: expected one of {', '.join(KERNELS)}, got {name!r}")
    return name.strip()


def bucket_of(rows: int) -> str:
    """The rows bucket that ``rows`` (>= 1) falls in."""
    for name, (lowest, _) in reversed(BUCKETS.items()):
        if rows >= lowest:
            return name
    raise ValueError(f"rows: expected a positive int, got {rows!r}")


@functools.cache
def _last_level_cache_bytes() -> int:
    """The largest cache that Linux reports for CPU 0 (0 where it reports none)."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text(encoding="ascii", errors="replace").strip().upper()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes)


def _pick(names: list[str], timings: dict[str, float]) -> str:
    """The fastest of ``names``, but the formula when it is among them and the fastest is
    not clearly faster (by ``_MARGIN``): a tight timing loop flatters kernels a little, and
    a gain within the noise is not worth leaving the formula for."""
    fastest = min(names, key=timings.__getitem__)
    if "formula" in names and _MARGIN * timings[fastest] > timings["formula"]:
        return "formula"
    return fastest


def _time_group(names: list[str], x: Tensor, copies: list[Tensor], bias: Tensor | None,
                expected: Tensor, fastest_us: float) -> dict[str, float]:
    """Median microseconds per call of each kernel in ``names`` on a prepared weight (each
    call on the next of its ``copies``, so that none is still in a cache), after a warm-up
    call that also checks the result. A kernel whose first timed call takes
    longer than the budget and ``_HOPELESS`` times the fastest so far (``fastest_us`` from
    other layouts) keeps that one timing: repeats would take seconds and only confirm that
    it loses."""
    rtol, atol = (1e-4, 1e-4) if x.dtype == torch.float32 else (3e-2, 3e-2)
    working = []
    for name in names:
        try:
            y = KERNELS[name].run(x, copies[0], bias)
        except RuntimeError as error:
            warnings.warn(f"kernel {name}: left out, it raised {error}", stacklevel=4)
            continue
        if y.shape != expected.shape or not torch.allclose(y.float(), expected.float(),
                                                           rtol=rtol, atol=atol):
            warnings.warn(f"kernel {name}: left out, its result differs from the formula's",
                          stacklevel=4)
            continue
        working.append(name)
    turn = itertools.count()
    first = {name: _timed(name, x, copies[next(turn) % len(copies)], bias) for name in working}
    fastest_us = min(fastest_us, *first.values()) if first else fastest_us
    hopeless = {name: us for name, us in first.items()
                if us > _HOPELESS * fastest_us and us > _BUDGET_US}
    samples = {name: [us] for name, us in first.items() if name not in hopeless}
    for repeat in range(1, _MAX_REPEATS):
        if repeat >= _MIN_REPEATS and all(sum(t) > _BUDGET_US for t in samples.values()):
            break
        for name, taken in samples.items():
            taken.append(_timed(name, x, copies[next(turn) % len(copies)], bias))
    return hopeless | {name: statistics.median(taken) for name, taken in samples.items()}


def _timed(name: str, x: Tensor, stored: Tensor, bias: Tensor | None) -> float:
    """Microseconds of one call of kernel ``name``."""
    run = KERNELS[name].run
    start = time.perf_counter()
    run(x, stored, bias)
    return (time.perf_counter() - start) * 1e6


def _check_names(argument: str, names: Iterable[str]) -> list[str]:
    if isinstance(names, str):
        raise TypeError(f"{argument}: expected a collection of kernel names, got {names!r}")
    names = list(names)
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"{argument}: expected names among {', '.join(KERNELS)}, got "
                         f"{unknown[0]!r}")
    return names


def _check_bucket(bucket: str) -> str:
    if bucket not in BUCKETS:
        raise ValueError(f"rows_bucket: expected one of {', '.join(BUCKETS)}, got {bucket!r}")
    return bucket
