"""`attnlab bench generate --quick` writes its table, data and plot; a context that runs out
of memory is a result."""

from __future__ import annotations

import json

import torch

from attnlab.bench import generate
from attnlab.cli import main


def test_bench_generate_quick(tmp_path, monkeypatch, one_thread, capsys) -> None:
    real = generate._context_row

    def context_row(model, ids, c, *args):  # the cache for 64 positions does not fit
        if c == 64:
            raise torch.OutOfMemoryError("out of memory")
        return real(model, ids, c, *args)

    monkeypatch.setattr(generate, "_context_row", context_row)
    assert main(["bench", "generate", "--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "generate.md").read_text()
    assert "with cache" in table and "## Machine" in table
    assert "| 64 | OOM | OOM | — | — |" in table
    data = json.loads((tmp_path / "generate.json").read_text())
    assert [row["context"] for row in data["rows"]] == [16, 32, 64]
    assert all(row["cached"]["seconds"] > 0 for row in data["rows"][:2])
    assert data["rows"][2]["cached"] == {"seconds": None, "error": "OOM"}
    assert (tmp_path / "generate.png").stat().st_size > 1000
    assert str(tmp_path) in capsys.readouterr().out


def test_bench_generate_speculative_quick(tmp_path, one_thread, capsys) -> None:
    """`--speculative` measures each proposer against plain decoding: one row per prompt and
    method, the same tokens, the drafts counted."""
    assert main(["bench", "generate", "--quick", "--speculative", "ngram:4", "--speculative",
                 "self:2", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "speculative.md").read_text()
    assert "| tokens/pass |" in table and "## Machine" in table and "- cpu: " in table
    assert "- ngram:4: random " in table
    rows = json.loads((tmp_path / "speculative.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["plain", "ngram:4", "self:2"] * 2
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 for r in rows)
    assert all((r["acceptance_rate"] is None) == (r["method"] == "plain") for r in rows)
