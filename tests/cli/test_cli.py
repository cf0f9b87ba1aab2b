"""The command line: the demo runs, and a developer benchmark that moved out of ``attnlab bench``
says where it went."""

import pytest

from attnlab.cli import main
from attnlab.cli.bench import MOVED


def test_demo_runs(capsys):
    assert main(["demo", "--intro"]) == 0
    assert "backends agree" in capsys.readouterr().out


@pytest.mark.parametrize("name", MOVED)
@pytest.mark.parametrize("rest", [[], ["--quick", "--out", "x"], ["--help"]])
def test_a_moved_benchmark_says_where_it_went(name, rest, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", name, *rest]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"attnlab bench {name}: moved to the repository's devbench/; "
                                 f"run `python -m devbench {name}` from a clone of attnlab\n")
    assert not list(tmp_path.iterdir())
