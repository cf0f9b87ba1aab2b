"""`attnlab bench generate --quick` writes its table, data and plot."""

from __future__ import annotations

import json

from attnlab.cli import main


def test_bench_generate_quick(tmp_path, capsys) -> None:
    assert main(["bench", "generate", "--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "generate.md").read_text()
    assert "with cache" in table and "## Machine" in table
    data = json.loads((tmp_path / "generate.json").read_text())
    assert [row["context"] for row in data["rows"]] == [16, 32, 64]
    assert all(row["cached"]["seconds"] > 0 for row in data["rows"])
    assert (tmp_path / "generate.png").stat().st_size > 1000
    assert str(tmp_path) in capsys.readouterr().out
