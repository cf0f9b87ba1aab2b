"""Calibration (what ``attnlab calibrate`` runs): the kernels are measured, cached on disk as
JSON keyed by machine and shape, read back instead of measuring again, and a plan made of the
timings; a corrupt or hostile cache is ignored with a warning and rewritten;
``ATTNLAB_KERNELS`` forces one kernel. The rule that decides without timings:
test_rule.py."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
from kernel_helpers import (
    own_cache_fixture,  # noqa: F401 (an autouse fixture)
    planted,
)

from attnlab.kernels import (
    BUCKETS,
    KERNELS,
    bucket_of,
    calibration,
    choose,
    measure,
    native,
    plan,
)
from attnlab.kernels.cache import _VERSION, cpu_model, entry_key

SHAPE = (24, 16)  # O x I: tiny, so that a whole calibration takes milliseconds


def _key(bucket: str, *, bias: bool) -> str:
    """The cache key of a float32 SHAPE measurement in this process."""
    return entry_key(torch.float32, *SHAPE, bucket, bias=bias, build=native.build_id())


def test_choose_returns_the_kernel_measured_fastest_and_caches_every_timing(own_cache):
    timings = measure(torch.float32, *SHAPE, "2-8")
    assert "formula" in timings and set(timings) <= set(KERNELS)
    assert all(t > 0 for t in timings.values())
    assert choose(torch.float32, *SHAPE, "2-8") == min(timings, key=timings.__getitem__)
    stored = json.loads(own_cache.read_text())
    key = _key("2-8", bias=True)
    assert stored["entries"][key] == timings
    for part in (cpu_model(), torch.__version__, f"{torch.get_num_threads()} threads",
                 "float32", "24x16", "rows 2-8"):
        assert part in key


def test_a_cached_timing_is_read_back_not_measured_again(own_cache, monkeypatch):
    first = measure(torch.float32, *SHAPE, "1")
    monkeypatch.setattr(calibration, "_TIMINGS", {})  # a new process: only the file is left

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although the cache holds the timings")

    monkeypatch.setattr(calibration, "measure_rows", no_measuring)
    assert measure(torch.float32, *SHAPE, "1") == first


def test_the_cache_key_names_the_native_build_and_the_libraries_instruction_sets(monkeypatch):
    """Timings of one native build (other sources, flags or ATTNLAB_NATIVE=0) or of torch's
    libraries held to another instruction set are never read for another: each is in the
    key, by a digest that needs no build."""
    monkeypatch.delenv("ATTNLAB_NATIVE", raising=False)
    monkeypatch.delenv("ATTNLAB_NATIVE_MARCH", raising=False)
    for name in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    native_key = _key("1", bias=True)
    monkeypatch.setenv("ATTNLAB_NATIVE_MARCH", "x86-64-v3")
    other_target = _key("1", bias=True)
    monkeypatch.setenv("ATTNLAB_NATIVE", "0")
    off = _key("1", bias=True)
    assert len({native_key, other_target, off}) == 3 and "native off" in off
    monkeypatch.delenv("ATTNLAB_NATIVE")
    monkeypatch.delenv("ATTNLAB_NATIVE_MARCH")
    assert _key("1", bias=True) == native_key
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    held = _key("1", bias=True)
    assert held != native_key and "MKL_ENABLE_INSTRUCTIONS=AVX2" in held
    with pytest.raises(TypeError, match="build: expected the native build's id"):
        entry_key(torch.float32, *SHAPE, "1", bias=True, build="")


def test_the_cache_key_separates_dtypes_shapes_buckets_bias_and_threads(own_cache):
    measure(torch.float32, *SHAPE, "1")
    measure(torch.bfloat16, *SHAPE, "1")
    measure(torch.float32, 16, 24, "1")
    measure(torch.float32, *SHAPE, "33+")
    measure(torch.float32, *SHAPE, "1", bias=False)
    keys = set(json.loads(own_cache.read_text())["entries"])
    assert len(keys) == 5
    assert _key("1", bias=False) in keys
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert _key("1", bias=True) not in keys
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("content", [
    b"\x00\xff not json at all",
    b"[1, 2, 3]",
    b'{"version": 99, "entries": {}}',
    b'{"version": %d, "entries": "everything"}' % _VERSION,
])
def test_a_corrupt_cache_file_is_ignored_with_a_warning_and_rewritten(own_cache, content):
    own_cache.parent.mkdir(parents=True)
    own_cache.write_bytes(content)
    with pytest.warns(UserWarning, match=f"kernel cache {own_cache}"):
        timings = measure(torch.float32, *SHAPE, "1")
    data = json.loads(own_cache.read_text())
    assert data["version"] == _VERSION
    assert data["entries"] == {_key("1", bias=True): timings}


@pytest.mark.parametrize("entry", [
    {"__import__('os').system('echo owned')": 1.0},  # a kernel name we do not know
    {"formula": -1.0},
    {"formula": float("nan")},
    {"formula": True},
    {"formula": "fast"},
    {},
    ["formula"],
])
def test_a_hostile_entry_is_never_trusted(own_cache, entry):
    key = _key("1", bias=True)
    good = _key("33+", bias=True)
    own_cache.parent.mkdir(parents=True)
    text = json.dumps({"version": _VERSION, "entries": {key: entry, good: {"formula": 5.0}}})
    own_cache.write_text(text)  # NaN written as JSON's NaN extension, as Python reads it
    with pytest.warns(UserWarning, match="1 invalid entries ignored"):
        timings = measure(torch.float32, *SHAPE, "1")
    assert set(timings) <= set(KERNELS) and "formula" in timings
    entries = json.loads(own_cache.read_text())["entries"]
    assert entries[key] == timings and entries[good] == {"formula": 5.0}


def test_a_cached_winner_decides_without_measuring(own_cache, monkeypatch):
    """The cache is what choose reads: a planted (valid) timing table decides."""
    own_cache.parent.mkdir(parents=True)
    key = _key("9-32", bias=True)
    own_cache.write_text(json.dumps({"version": _VERSION, "entries": {
        key: dict.fromkeys(KERNELS, 100.0) | {"columns": 1.0, "rows_gemv": 50.0}}}))
    monkeypatch.setattr(calibration, "measure_rows", lambda *a, **k: pytest.fail("measured"))
    assert choose(torch.float32, *SHAPE, "9-32") == "columns"
    assert choose(torch.float32, *SHAPE, "9-32", kernels=["formula", "rows_gemv"]) == "rows_gemv"


def test_an_unwritable_cache_folder_warns_and_calibration_still_works(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(blocker / "below"))  # below a plain file
    with pytest.warns(UserWarning, match="not written"):
        assert set(measure(torch.float32, *SHAPE, "1")) <= set(KERNELS)
    assert choose(torch.float32, *SHAPE, "1") in KERNELS


def test_the_environment_forces_one_kernel_without_measuring(own_cache, monkeypatch):
    monkeypatch.setenv("ATTNLAB_KERNELS", "formula")
    monkeypatch.setattr(calibration, "measure_rows", lambda *a, **k: pytest.fail("measured"))
    assert all(choose(torch.float32, *SHAPE, b) == "formula" for b in BUCKETS)
    assert plan(torch.bfloat16, *SHAPE) == ("rows", dict.fromkeys(BUCKETS, "formula"))
    assert not own_cache.exists()
    monkeypatch.setenv("ATTNLAB_KERNELS", "columns")
    assert plan(torch.float32, *SHAPE) == ("columns", dict.fromkeys(BUCKETS, "columns"))
    # A kernel that cannot run a dtype or row count gives the formula there.
    assert choose(torch.float64, *SHAPE, "1") == "formula"
    assert plan(torch.float64, *SHAPE) == ("rows", dict.fromkeys(BUCKETS, "formula"))
    monkeypatch.setenv("ATTNLAB_KERNELS", "blocks_gemv")
    assert choose(torch.float32, *SHAPE, "2-8") == "formula"


def test_an_argument_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("ATTNLAB_KERNELS", "formula")
    assert choose(torch.float32, *SHAPE, "1", kernel="columns") == "columns"


@pytest.mark.parametrize(("source", "value"), [("env", "fastest"), ("env", "formula,columns"),
                                               ("argument", "FORMULA"), ("argument", 3)])
def test_an_unknown_forced_kernel_is_refused_naming_where_it_came_from(monkeypatch, source,
                                                                        value):
    if source == "env":
        monkeypatch.setenv("ATTNLAB_KERNELS", value)
        match, call = "ATTNLAB_KERNELS: expected one of formula, ", {}
    else:
        match, call = "kernel: expected one of formula, ", {"kernel": value}
    with pytest.raises(ValueError, match=match) as error:
        choose(torch.float32, *SHAPE, "1", **call)
    assert repr(value) in str(error.value)


def test_measuring_runs_under_inference_mode(monkeypatch):
    seen = []
    kernel = KERNELS["columns"]
    spy = dataclasses.replace(kernel, run=lambda *a: seen.append(
        torch.is_inference_mode_enabled()) or kernel.run(*a))
    monkeypatch.setitem(KERNELS, "columns", spy)
    calibration.measure_rows(torch.float32, *SHAPE, 3, ["columns"])
    assert len(seen) >= 4 and all(seen)  # the check-and-warm-up call and >= 3 repeats


def test_a_wrong_kernel_is_left_out_with_a_warning(monkeypatch):
    kernel = KERNELS["columns"]
    wrong = dataclasses.replace(kernel, run=lambda *a: kernel.run(*a) + 1)
    monkeypatch.setitem(KERNELS, "columns", wrong)
    with pytest.warns(UserWarning, match="kernel columns: left out, its result differs"):
        timings = calibration.measure_rows(torch.float32, *SHAPE, 3)
    assert "columns" not in timings and "formula" in timings


def test_a_hopelessly_slow_kernel_is_timed_once(monkeypatch):
    """Repeating a call that is already over the budget and 10x the fastest would take
    seconds on a large matrix and only confirm that it loses. The slow kernel sleeps 1 s: the
    formula's tiny product stays under a tenth of that however busy the machine."""
    calls = []
    kernel = KERNELS["rows_gemv"]

    def slow(*args):
        calls.append(1)
        time.sleep(1.0)
        return kernel.run(*args)

    monkeypatch.setitem(KERNELS, "rows_gemv", dataclasses.replace(kernel, run=slow))
    timings = calibration.measure_rows(torch.float32, *SHAPE, 2, ["formula", "rows_gemv"])
    assert len(calls) == 2  # the checked warm-up and one timing
    assert timings["rows_gemv"] >= 1_000_000 > timings["formula"]


def test_a_dtype_only_the_formula_runs_is_planned_on_the_formula():
    assert plan(torch.float64, *SHAPE) == ("rows", dict.fromkeys(BUCKETS, "formula"))
    assert plan(torch.float64, *SHAPE, layouts=("columns",)) == (
        "rows", dict.fromkeys(BUCKETS, "formula"))


def test_buckets_cover_every_row_count():
    assert [bucket_of(m) for m in (1, 2, 8, 9, 32, 33, 10**6)] == [
        "1", "2-8", "2-8", "9-32", "9-32", "33+", "33+"]
    with pytest.raises(ValueError, match="rows: expected a positive int, got 0"):
        bucket_of(0)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: choose(torch.float32, *SHAPE, "2-9"), "rows_bucket: expected one of 1, 2-8"),
    (lambda: measure(torch.float32, *SHAPE, "1", kernels=["magic"]),
     "kernels: expected names among formula, .* got 'magic'"),
    (lambda: measure(torch.float32, *SHAPE, "1", kernels="formula"), "kernels: expected a "),
    (lambda: calibration.measure_rows(torch.float32, 0, 16, 1), "out_features: expected a "),
    (lambda: calibration.measure_rows(torch.int64, 8, 16, 1), "dtype: expected a floating"),
    (lambda: plan(torch.float32, *SHAPE, layouts=("packed",)), "layouts: expected 'rows'"),
])
def test_bad_arguments_are_refused_by_name(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_plan_keeps_one_layout_for_every_bucket(monkeypatch):
    """A weight is stored once: a plan never mixes row- and column-major kernels, and the
    packed copy only with extra_memory."""
    fast = {"formula": 10.0, "onednn": 9.0, "blocks_gemv": 8.0, "columns": 5.0,
            "onednn_columns": 6.0, "rows_gemv": 7.0, "onednn_packed": 1.0}
    monkeypatch.setattr(calibration, "cached", planted(fast))
    layout, picks = plan(torch.float32, *SHAPE)
    assert (layout, set(picks.values())) == ("columns", {"columns"})
    assert plan(torch.float32, *SHAPE, layouts=("rows",)) == ("rows", dict.fromkeys(
        BUCKETS, "blocks_gemv"))
    assert plan(torch.float32, *SHAPE, extra_memory=True)[1] == dict.fromkeys(
        BUCKETS, "onednn_packed")


def test_plan_never_trades_one_bucket_for_another_below_the_formula(monkeypatch):
    """Column-major kernels twice as fast for one row but 1.2x slower than the formula for
    several: the weight stays row-major (batched decoding would lose)."""
    def timings(d, o, i, bucket, kernels=None, bias=True):
        columns = 5.0 if bucket == "1" else 12.0
        fast = dict.fromkeys(KERNELS, 30.0) | {"formula": 10.0, "columns": columns}
        return {n: fast[n] for n in ("formula", *kernels)}

    monkeypatch.setattr(calibration, "cached", timings)
    assert plan(torch.float32, *SHAPE) == ("rows", dict.fromkeys(BUCKETS, "formula"))
    assert plan(torch.float32, *SHAPE, layouts=("columns",)) == (
        "rows", dict.fromkeys(BUCKETS, "formula"))


@pytest.mark.parametrize(("onednn", "columns", "expected"), [
    (9.5, 30.0, ("rows", "formula")),   # 5% faster: within the noise, the formula stays
    (8.0, 30.0, ("rows", "onednn")),    # 20% faster: worth it
    (30.0, 9.5, ("rows", "formula")),   # re-storing every weight for 5%: not worth it
    (30.0, 8.0, ("columns", "columns")),
])
def test_a_choice_must_beat_the_formula_clearly(monkeypatch, onednn, columns, expected):
    fast = dict.fromkeys(KERNELS, 30.0) | {"formula": 10.0, "onednn": onednn,
                                           "columns": columns}
    monkeypatch.setattr(calibration, "cached", planted(fast))
    layout, picks = plan(torch.float32, *SHAPE)
    assert (layout, *set(picks.values())) == expected


def test_timings_cycle_through_copies_past_twice_the_last_level_cache(monkeypatch):
    """A CPU may report hundreds of MB of L3: copies of a weight that fit there would be timed
    warm, so the copies add up to twice the largest cache (at least 128 MiB, at most 2 GiB
    and 4096 copies)."""
    for llc in (32 * 2**20, 480 * 2**20):
        monkeypatch.setattr(calibration, "_last_level_cache_bytes", lambda llc=llc: llc)
        for bytes_each in (2**20, 136 * 2**20, 300 * 2**20):
            count = calibration.cold_copies(bytes_each)
            assert count * bytes_each >= max(2 * llc, 128 * 2**20)
            assert (count - 1) * bytes_each < max(2 * llc, 128 * 2**20)
    assert calibration.cold_copies(3 * 2**30) == 1
    assert calibration.cold_copies(100) == 4096
    with pytest.raises(ValueError, match="bytes_each"):
        calibration.cold_copies(0)


def test_the_last_level_cache_is_read_from_linux():
    size = calibration._last_level_cache_bytes()
    assert size >= 0 and (size > 0) == any(
        Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))


def test_a_module_is_timed_with_a_bias_only_when_it_has_one(own_cache, monkeypatch):
    """BLAS runs x W^T and x W^T + b by different paths (on an AVX2 CPU the bfloat16 GEMV of a
    151936 x 896 head took 12 ms with a bias and 17-23 ms without): a module's kernels are
    chosen on timings of the call it makes."""
    biases = []
    real = calibration.KERNELS["formula"].run

    def formula(x, weight, bias):
        biases.append(bias is not None)
        return real(x, weight, bias)

    monkeypatch.setitem(calibration.KERNELS, "formula", dataclasses.replace(
        calibration.KERNELS["formula"], run=formula))
    plan(torch.float32, *SHAPE, bias=False, measure_now=True)
    assert biases and not any(biases)
    biases.clear()
    plan(torch.float32, *SHAPE, bias=True, measure_now=True)
    assert biases and all(biases)
    keys = json.loads(own_cache.read_text())["entries"]
    assert {k.rsplit(" | ", 1)[1] for k in keys} == {"bias", "no bias"}


@pytest.mark.parametrize("call", [
    lambda: measure(torch.float32, *SHAPE, "1", bias="no"),
    lambda: calibration.measure_rows(torch.float32, *SHAPE, 1, bias=0),
    lambda: plan(torch.float32, *SHAPE, bias=None),
])
def test_a_bias_that_is_not_a_bool_is_refused_by_name(call):
    with pytest.raises(TypeError, match="bias: expected a bool"):
        call()
