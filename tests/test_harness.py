"""The benchmark harness: interleaved timing."""

import pytest

from attnlab.bench.harness import time_median, time_medians


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
