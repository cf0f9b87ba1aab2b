"""``python -m attnlab.kernels.calibrate``: a table of measured kernels, bad options refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kernel_helpers import own_cache_fixture  # noqa: F401 (an autouse fixture)

from attnlab.kernels import KERNELS
from attnlab.kernels.calibrate import main

# A hang guard, not the expected time: in a fresh cache the command first builds the C++
# kernels (1-3 min on an idle 2-core machine, several times that on a busy one).
HANG_S = 1200


def calibrate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnlab.kernels.calibrate", *args],
                          capture_output=True, text=True, timeout=HANG_S)


def test_it_prints_one_row_per_dtype_shape_and_rows_with_the_winner(own_cache):
    done = calibrate("--dtype", "float32", "bfloat16", "--shape", "24x16", "8X4",
                     "--rows", "1", "3", "--threads", "1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("CPU: ") and "1 threads" in lines[0]
    header = [cell.strip() for cell in lines[1].strip("|").split("|")]
    assert header == ["dtype", "O x I", "rows", *KERNELS, "winner"]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[3:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (d, s, m) for d in ("float32", "bfloat16") for s in ("24x16", "8x4") for m in "13"]
    for row in rows:
        times = {name: float(cell) for name, cell in zip(KERNELS, row[3:-1]) if cell != "-"}
        assert times[row[-1]] == min(times.values())  # equal when rounded alike
        assert "formula" in times
    assert not own_cache.exists()  # the table measures afresh and leaves the cache alone


@pytest.mark.parametrize(("args", "message"), [
    (["--shape", "4864"], "argument --shape: expected OUTxIN with two positive ints"),
    (["--shape", "0x8"], "argument --shape: expected OUTxIN"),
    (["--shape", "8x8", "--rows", "0"], "argument --rows: expected a positive int, got '0'"),
    (["--shape", "8x8", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--shape", "8x8", "--kernels", "magic"], "argument --kernels: invalid choice: 'magic'"),
    (["--shape", "99999999x99999999", "--rows", "1"], "--rows 1: not measured"),
])
def test_bad_options_are_refused_with_a_message(args, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "bias"), [([], True), (["--no-bias"], False)])
def test_no_bias_times_the_product_without_one(flag, bias, monkeypatch, capsys):
    import attnlab.kernels.calibrate as cli

    asked = []

    def measured(*args, bias):
        asked.append(bias)
        return {"formula": 1.0}

    monkeypatch.setattr(cli, "measure_rows", measured)
    main(["--shape", "8x4", "--rows", "1", *flag])
    assert asked == [bias] and "| formula |" in capsys.readouterr().out
