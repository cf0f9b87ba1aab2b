"""The benchmark harness: interleaved timing, and the record of the machine's state during a
run (load average, spread of the repeats) with its warning line on the table."""

import os
import time
from types import SimpleNamespace

import pytest
import torch

from attnlab.bench import harness
from attnlab.bench.harness import (
    begin_run,
    machine_info,
    machine_section,
    oom_as_error,
    time_median,
    time_medians,
)
from devbench.cli import main


def test_time_medians_takes_turns_and_turns_the_order_each_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    medians = time_medians(fns, repeats=4, warmup=1)
    assert set(medians) == {"a", "b", "c"}
    assert all(m >= 0 for m in medians.values())
    assert "".join(calls) == "abc" + "abc" + "bca" + "cab" + "abc"


def test_time_medians_stops_adding_rounds_after_the_third_once_over_budget():
    calls = []
    time_medians({"a": lambda: calls.append(1)}, repeats=50, warmup=0, budget_s=0.0)
    assert len(calls) == 3
    assert time_median(lambda: None, repeats=5, warmup=0) >= 0
    assert time_medians({}) == {}


def test_time_medians_refuses_zero_repeats():
    # (was: statistics.StatisticsError from the median of no times)
    with pytest.raises(ValueError, match="repeats: expected a positive int, got 0"):
        time_medians({"a": lambda: None}, repeats=0)
    with pytest.raises(ValueError, match="repeats"):
        time_median(lambda: None, repeats=-1)


def fake_clock(monkeypatch: pytest.MonkeyPatch, durations: list[float]):
    """The harness's clock advanced only by the returned function's calls, by ``durations``
    in turn: timings without the machine's speed in them."""
    now = [0.0]
    monkeypatch.setattr(harness, "time", SimpleNamespace(
        perf_counter=lambda: now[0], strftime=time.strftime, gmtime=time.gmtime))
    steps = iter(durations)

    def fn() -> None:
        now[0] += next(steps)

    return fn


def timed_run(monkeypatch, *, load: float, durations: list[float]) -> dict[str, str]:
    """``machine_info`` after a run on 2 usable CPUs at ``load`` that timed one figure."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    begin_run()
    fn = fake_clock(monkeypatch, durations)
    assert time_median(fn, repeats=len(durations), warmup=0) == pytest.approx(sorted(durations)[1])
    return machine_info()


def test_a_quiet_run_with_agreeing_repeats_has_no_warning(monkeypatch):
    info = timed_run(monkeypatch, load=1.5, durations=[1.0, 1.05, 1.0])
    assert info["usable cpus"] == "2"
    assert info["load average (1 min)"] == "1.50 at start, 1.50 at end"
    assert info["spread of repeats"].startswith("median 5.0%, worst 5.0%; 0 of 1 figures over 10%")
    assert "warning" not in info
    assert not any("Warning" in line for line in machine_section(info))


def test_a_busy_machine_is_a_warning_on_the_table(monkeypatch):
    info = timed_run(monkeypatch, load=3.25, durations=[1.0, 1.05, 1.0])
    assert info["warning"].startswith("the machine was busy (load 3.2 on 2 usable CPUs): ")
    lines = machine_section(info)
    assert lines[3] == f"> **Warning:** {info['warning']}"
    assert "- load average (1 min): 3.25 at start, 3.25 at end" in lines


def test_disagreeing_repeats_are_a_warning_on_the_table(monkeypatch):
    info = timed_run(monkeypatch, load=0.5, durations=[1.0, 1.5, 1.25])
    assert info["spread of repeats"].startswith("median 40.0%, worst 40.0%; 1 of 1 figures")
    assert info["warning"].startswith("the repeats disagree (spread up to 40%, over 10%): ")
    assert f"> **Warning:** {info['warning']}" in machine_section(info)


def test_the_load_at_the_start_counts_too(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0, 0.0, 0.0))
    begin_run()
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 0.0, 0.0))
    info = machine_info()
    assert info["load average (1 min)"] == "4.00 at start, 1.00 at end"
    assert "spread of repeats" not in info  # nothing timed since the run began
    assert info["warning"].startswith("the machine was busy (load 4.0 on 2 usable CPUs)")


def test_a_benchmark_table_carries_the_load_and_the_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert main(["mha", "--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "mha.md").read_text()
    assert "> **Warning:** the machine was busy (load 9.0 on 2 usable CPUs)" in table
    assert "- load average (1 min): 9.00 at start, 9.00 at end" in table
    assert "- spread of repeats: median " in table
    assert "the machine was busy" in capsys.readouterr().out


def test_oom_as_error_records_out_of_memory_and_lets_other_errors_through():
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def broken():
        raise RuntimeError("shape mismatch")

    assert oom_as_error(oom) == (None, "OOM")
    assert oom_as_error(lambda: 3) == (3, None)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        oom_as_error(broken)
