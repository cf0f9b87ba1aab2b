"""Choosing a kernel: which of :data:`~attnlab.kernels.catalog.KERNELS` computes ``x W^T + b``
for a dtype, a shape ``O x I`` and a rows bucket (:data:`~attnlab.kernels.rule.BUCKETS`).

A load never times anything: :func:`plan` takes the plan that ``attnlab calibrate`` measured
on this machine when the cache (:mod:`attnlab.kernels.cache`) holds one for the exact key
(CPU, torch, threads, native build, dtype, shape, bucket, bias), else the fixed rule
(:func:`attnlab.kernels.rule.rule`). Measuring (:func:`measure`, :func:`measure_rows`) is
what ``attnlab calibrate`` asks for: every candidate kernel timed on random data under
``torch.inference_mode()``, a few interleaved repeats each (median), after checking its
result against the formula's, and the timings written to the cache.
``ATTNLAB_KERNELS=<name>`` (or a ``kernel`` argument) forces one kernel everywhere; the
variable may name a quantized kernel too (``attnlab.quantization.kernels``), which float
weights then ignore, and ``formula`` / ``dequantize`` force both kinds' formula.
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
from attnlab.kernels.catalog import KERNELS, LAYOUTS, Kernel
from attnlab.kernels.rule import BUCKETS, QUANTIZED_NAMES, bucket_of, features, largest, rule

__all__ = [
    "BUCKETS",
    "KNOWN_NAMES",
    "bucket_of",
    "cached",
    "choose",
    "cold_copies",
    "forced_by_environment",
    "forced_kernel",
    "measure",
    "measure_rows",
    "measured_plan",
    "plan",
    "rule_plan",
    "stored_timings",
    "time_kernels",
    "weight_like",
    "write_timings",
]

_ENV, _ALIAS = "ATTNLAB_KERNELS", "ATTNLAB_QUANTIZED_KERNELS"
# Every kernel name the cache file and $ATTNLAB_KERNELS may hold: float and quantized.
KNOWN_NAMES = (*KERNELS, *QUANTIZED_NAMES)
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
    """The kernel for ``x (M x I) W^T (I x O)`` (``+ b`` when ``bias``) in ``dtype`` with
    ``M`` in ``rows_bucket``: the fastest of ``kernels`` (default all) in the timings that
    ``attnlab calibrate`` wrote for this key, else the rule's (the formula when the rule's
    kernel is not among ``kernels``); nothing is timed. ``kernel`` (or ``$ATTNLAB_KERNELS``)
    forces one instead; a forced kernel that cannot run this dtype gives ``"formula"``."""
    forced = forced_kernel(kernel)
    _check_bucket(rows_bucket)
    if forced is not None:
        lowest = BUCKETS[rows_bucket][0]
        like = weight_like(dtype, out_features, in_features)
        return forced if KERNELS[forced].available(like, dtype, lowest) else "formula"
    timings = cached(dtype, out_features, in_features, rows_bucket, kernels, bias=bias)
    if timings:
        return min(timings, key=timings.__getitem__)
    ruled = rule_plan(dtype, out_features, in_features)[1][rows_bucket]
    return ruled if kernels is None or ruled in _check_names("kernels", kernels) else "formula"


def plan(dtype: torch.dtype, out_features: int, in_features: int, *,
         layouts: Sequence[str] = ("rows", "columns"), extra_memory: bool = False,
         kernel: str | None = None, bias: bool = True, measure_now: bool = False
         ) -> tuple[str, dict[str, str]]:
    """One weight's storage and its kernel per rows bucket: ``(layout, {bucket: kernel})``,
    for a module that adds a bias or not (``bias``).

    A forced ``kernel`` (or ``$ATTNLAB_KERNELS``) for every bucket. Else, when the cache
    holds timings for every bucket of this key (``attnlab calibrate`` wrote them; with
    ``measure_now``, what is missing is measured now and written), the measured plan
    (:func:`measured_plan`); else the rule (:func:`rule_plan`). Without ``measure_now``
    nothing is timed.
    """
    for layout in layouts:
        if layout not in LAYOUTS[:2]:
            raise ValueError(f"layouts: expected 'rows' or 'columns', got {layout!r}")
    if not isinstance(bias, bool):
        raise TypeError(f"bias: expected a bool, got {bias!r}")
    forced = forced_kernel(kernel)
    if forced is not None:
        picks = {b: choose(dtype, out_features, in_features, b, kernel=forced) for b in BUCKETS}
        layout = KERNELS[forced].layout if forced in picks.values() else "rows"
        return ("rows" if layout == "packed" else layout), picks
    allowed = {*layouts, "packed"} if extra_memory else set(layouts)
    candidates = [name for name, k in KERNELS.items() if k.layout in allowed]
    lookup = measure if measure_now else cached
    timings = {b: lookup(dtype, out_features, in_features, b, candidates, bias=bias)
               for b in BUCKETS}
    if all(timings.values()):
        return measured_plan(timings, layouts, extra_memory)
    return rule_plan(dtype, out_features, in_features, extra_memory=extra_memory)


def rule_plan(dtype: torch.dtype, out_features: int, in_features: int, *,
              extra_memory: bool = False) -> tuple[str, dict[str, str]]:
    """The rule's plan (:func:`attnlab.kernels.rule.rule` on this machine's features):
    ``("rows", {bucket: kernel})``, per bucket the first of the rule's kernels that runs the
    bucket's every row count for ``out_features`` outputs, else the formula. Every kernel the
    rule names reads the weight as stored (row-major, or oneDNN's packed copy beside it
    with ``extra_memory``); a dtype other than float32 and bfloat16 runs the formula."""
    check_positive("out_features", out_features)
    check_positive("in_features", in_features)
    if dtype not in (torch.float32, torch.bfloat16):
        return "rows", dict.fromkeys(BUCKETS, "formula")
    scheme = str(dtype).removeprefix("torch.")
    ruled = rule(scheme, dtype, features(), extra_memory=extra_memory)
    like = weight_like(dtype, out_features, in_features)
    return "rows", {b: next((n for n in names if KERNELS[n].available(like, dtype, largest(b))),
                            "formula") for b, names in ruled.items()}


def measured_plan(timings: dict[str, dict[str, float]], layouts: Sequence[str],
                  extra_memory: bool) -> tuple[str, dict[str, str]]:
    """The plan from ``timings`` (``{bucket: {kernel: microseconds}}``, the formula among
    them), for a weight stored once, in one of ``layouts``, so that every bucket must use a
    kernel that runs on that storage (with ``extra_memory``, oneDNN's packed copy beside it
    is allowed too). A layout is a candidate only if its kernel is, in every bucket, no
    slower than the formula (what ``nn.Linear`` runs): a faster one-row decode must not cost
    a slower batched decode or prefill. Among the candidates, the one that loses least
    against each bucket's fastest kernel, summed over the buckets (``sum_b t_layout(b) /
    t_best(b)``); the first of ``layouts`` unless another is better by ``_MARGIN`` (10%),
    and within a layout the formula unless a kernel beats it by that much; with no
    candidate, the formula."""
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


def cached(dtype: torch.dtype, out_features: int, in_features: int, rows_bucket: str,
           kernels: Iterable[str] | None = None, *, bias: bool = True) -> dict[str, float]:
    """The timings that the cache holds for this key, of ``kernels`` (default all) that can
    run the bucket's representative row count: ``{}`` when it holds none, or none of the
    formula (then no plan was measured for the key). Never times anything."""
    names = _check_names("kernels", KERNELS if kernels is None else kernels)
    if not isinstance(bias, bool):
        raise TypeError(f"bias: expected a bool, got {bias!r}")
    rows = BUCKETS[_check_bucket(rows_bucket)][1]
    key = cache.entry_key(dtype, out_features, in_features, rows_bucket, bias=bias,
                          build=native.build_id())
    stored = stored_timings(key)
    if "formula" not in stored:
        return {}
    like = weight_like(dtype, out_features, in_features)
    return {n: stored[n] for n in dict.fromkeys(("formula", *names))
            if n in stored and math.isfinite(stored[n])
            and KERNELS[n].available(like, dtype, rows)}


def measure(dtype: torch.dtype, out_features: int, in_features: int, rows_bucket: str,
            kernels: Iterable[str] | None = None, *, bias: bool = True) -> dict[str, float]:
    """Median microseconds per call of each of ``kernels`` (default all) that can run, at the
    bucket's representative row count, with a bias or not (``bias``): from the cache when it
    holds them, else measured now and added to it (what ``attnlab calibrate`` runs; a load
    never does). At least ``"formula"`` is always there."""
    names = _check_names("kernels", KERNELS if kernels is None else kernels)
    rows = BUCKETS[_check_bucket(rows_bucket)][1]
    like = weight_like(dtype, out_features, in_features)
    names = [n for n in dict.fromkeys(("formula", *names)) if KERNELS[n].available(like, dtype,
                                                                                    rows)]
    key = cache.entry_key(dtype, out_features, in_features, rows_bucket, bias=bias,
                          build=native.build_id())
    known = stored_timings(key)
    missing = [n for n in names if n not in known]
    if missing:
        measured = measure_rows(dtype, out_features, in_features, rows, missing, bias=bias)
        # A kernel left out (it raised or was wrong) is not tried again in this process.
        known.update({n: measured.get(n, math.inf) for n in missing})
        write_timings(key, known)
    return {n: known[n] for n in names if math.isfinite(known[n])}


def write_timings(key: str, timings: dict[str, float]) -> None:
    """Add ``timings`` (finite ones) to the cache file under ``key``, keeping its other
    entries; what :func:`measure` and the quantized kernels' measuring write."""
    path = cache.cache_file()
    entries = cache.read_entries(path, KNOWN_NAMES)
    entries[key] = {n: t for n, t in timings.items() if math.isfinite(t)}
    cache.write_entries(path, entries)


def stored_timings(key: str) -> dict[str, float]:
    """The timings held for ``key`` (float or quantized) in this process, read from the cache
    file once: a dict that the measuring updates in place."""
    if key not in _TIMINGS:
        stored = cache.read_entries(cache.cache_file(), KNOWN_NAMES).get(key)
        _TIMINGS[key] = dict(stored) if stored else {}
    return _TIMINGS[key]


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
    like = weight_like(dtype, out_features, in_features)
    names = [n for n in names if KERNELS[n].available(like, dtype, rows)]
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
        tolerance = (1e-4, 1e-4) if dtype == torch.float32 else (3e-2, 3e-2)
        for layout in dict.fromkeys(KERNELS[n].layout for n in names):
            group = [n for n in names if KERNELS[n].layout == layout]
            copies = [KERNELS[group[0]].prepare(weight.clone() if i else weight, dtype)
                      for i in range(count)]
            timings.update(time_kernels({n: (KERNELS[n], copies) for n in group}, x, b,
                                        expected, tolerance,
                                        fastest_us=min(timings.values(), default=math.inf)))
            del copies
    return timings


def cold_copies(bytes_each: int) -> int:
    """How many copies of a ``bytes_each`` weight a timing cycles through so that none is
    still cached when it is read again: ``ceil(max(2 x last-level cache, 128 MiB) /
    bytes_each)``, at most 4096 copies and 2 GiB in all (and at least one copy)."""
    check_positive("bytes_each", bytes_each)
    cold = min(_MAX_COLD_BYTES, max(_COLD_BYTES, 2 * _last_level_cache_bytes()))
    return max(1, min(-(-cold // bytes_each), _MAX_COPIES))


def weight_like(dtype: torch.dtype, out_features: int, in_features: int) -> Tensor:
    """A weight's stand-in for :meth:`Kernel.available <attnlab.kernels.catalog.Kernel>`:
    its shape and dtype, no storage (``meta``)."""
    return torch.empty(out_features, in_features, dtype=dtype, device="meta")


def forced_kernel(kernel: str | None = None) -> str | None:
    """The float kernel forced for every call: ``kernel`` when given (one of
    :data:`KERNELS`), else :func:`forced_by_environment`'s, where it names a float kernel
    (``dequantize``, the quantized formula, means the formula), else None (plan or rule)."""
    if kernel is not None:
        if not isinstance(kernel, str) or kernel.strip() not in KERNELS:
            raise ValueError(f"kernel: expected one of {', '.join(KERNELS)}, got {kernel!r}")
        return kernel.strip()
    name = forced_by_environment()
    name = "formula" if name == "dequantize" else name
    return name if name in KERNELS else None


def forced_by_environment() -> str | None:
    """The kernel that ``$ATTNLAB_KERNELS`` forces (float or quantized; None when unset or
    empty), checked against every kernel name. ``$ATTNLAB_QUANTIZED_KERNELS``, its old
    quantized-only spelling, is read where ``$ATTNLAB_KERNELS`` is not set, with a warning."""
    source, name = _ENV, os.environ.get(_ENV, "").strip()
    if not name and os.environ.get(_ALIAS, "").strip():
        source, name = _ALIAS, os.environ[_ALIAS].strip()
        warnings.warn(f"{_ALIAS} is an old name of {_ENV}, which forces float and quantized "
                      f"kernels alike: set {_ENV}={name} instead", FutureWarning, stacklevel=3)
    if not name:
        return None
    if name not in KNOWN_NAMES:
        raise ValueError(f"{source}: expected one of {', '.join(KNOWN_NAMES)}, got "
                         f"{os.environ[source]!r}")
    return name


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


def time_kernels(prepared: dict[str, tuple[Kernel, list]], x: Tensor, bias: Tensor | None,
                 expected: Tensor, tolerance: tuple[float, float], *,
                 fastest_us: float = math.inf) -> dict[str, float]:
    """Median microseconds per call of each kernel, float or quantized, ``{name: (kernel,
    stored copies)}`` (what its ``prepare`` made of copies of one weight that together
    exceed the caches: each call reads the next, as a decoder reads each weight from memory
    once per token), timed in interleaved rounds so that a burst of load on a shared machine
    hits them alike. A warm-up call checks each against ``expected`` (``(rtol, atol)``
    ``tolerance``); a kernel that raises or differs is left out with a warning. A kernel
    whose first timed call takes longer than the budget and ``_HOPELESS`` times the fastest
    so far (``fastest_us`` from other calls) keeps that one timing: repeats would take
    seconds and only confirm that it loses. What ``attnlab calibrate`` runs, for both."""
    rtol, atol = tolerance
    working = []
    for name, (kernel, copies) in prepared.items():
        try:
            y = kernel.run(x, copies[0], bias)
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

    def timed(name: str) -> float:
        kernel, copies = prepared[name]
        stored = copies[next(turn) % len(copies)]
        start = time.perf_counter()
        kernel.run(x, stored, bias)
        return (time.perf_counter() - start) * 1e6

    first = {name: timed(name) for name in working}
    fastest_us = min(fastest_us, *first.values()) if first else fastest_us
    hopeless = {name: us for name, us in first.items()
                if us > _HOPELESS * fastest_us and us > _BUDGET_US}
    samples = {name: [us] for name, us in first.items() if name not in hopeless}
    for repeat in range(1, _MAX_REPEATS):
        if repeat >= _MIN_REPEATS and all(sum(t) > _BUDGET_US for t in samples.values()):
            break
        for name, taken in samples.items():
            taken.append(timed(name))
    return hopeless | {name: statistics.median(taken) for name, taken in samples.items()}


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
