"""`attnlab bench qwen2 --quick` writes its table (ours and transformers), data and plot."""

from __future__ import annotations

import json

from attnlab.cli import main


def test_bench_qwen2_quick(tmp_path, one_thread, capsys) -> None:
    assert main(["bench", "qwen2", "--quick", "--dtype", "bfloat16", "--out",
                 str(tmp_path)]) == 0
    table = (tmp_path / "qwen2.md").read_text()
    assert "| ours | float32 |" in table and "## Machine" in table
    assert "Next-token agreement" in table and "Batched decode" in table
    data = json.loads((tmp_path / "qwen2.json").read_text())
    names = [row["name"] for row in data["rows"]]
    assert names[:3] == ["ours", "ours, stored layout", "ours bfloat16"]
    assert all(row["decode_tokens_per_s"] > 0 and row["prefill_s"] > 0 for row in data["rows"])
    assert data["bandwidth_gbs"] > 0 and 0 <= data["agreement"] <= 1
    assert (tmp_path / "qwen2.png").stat().st_size > 1000
    assert str(tmp_path) in capsys.readouterr().out
