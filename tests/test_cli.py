"""The command line: the demo runs, and the benchmarks write their files."""

import pytest

from attnlab.cli import main


def test_demo_runs(capsys):
    assert main(["demo", "--intro"]) == 0
    assert "backends agree" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["attention", "mha"])
def test_bench_quick_writes_table_and_plot(tmp_path, name, capsys):
    assert main(["bench", name, "--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / f"{name}.md").read_text()
    assert "| " in table and "## Machine" in table
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert str(tmp_path) in capsys.readouterr().out


def test_bench_rejects_bad_lengths(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "attention", "--lengths", "0,x"])
