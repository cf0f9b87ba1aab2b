"""``python -m devbench sampling``: both samplers timed in one run, the table written with its
machine, and the reference's warpers given the settings that were asked for."""

from __future__ import annotations

import json

import pytest

from devbench.cli import main

pytest.importorskip("transformers")


def test_quick_run_writes_a_table_of_ratios_and_the_json(tmp_path, capsys):
    assert main(["sampling", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sampling.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["T=1", "T=0.7, top-p 0.8",
                                            "T=0.7, top-k 20, top-p 0.8", "T=0.7, top-k 50"]
    assert all(r["ours_ms"] > 0 and r["reference_ms"] > 0 for r in rows)
    md = (tmp_path / "sampling.md").read_text()
    assert "| 1 | 32000 | T=0.7, top-k 20, top-p 0.8 |" in md and "## Machine" in md
    ratio = rows[2]["reference_ms"] / rows[2]["ours_ms"]
    assert f"{ratio:.1f}x |" in md
    assert "transformers ms" in capsys.readouterr().out
