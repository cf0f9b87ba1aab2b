"""``python -m devbench variants --quick`` writes its table, JSON and plot (a smoke run)."""

from __future__ import annotations

import json

from devbench.cli import main
from devbench.variants import VARIANTS


def test_quick_run_writes_table_json_and_plot(tmp_path, one_thread, capsys):
    assert main(["variants", "--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "variants.md").read_text()
    for variant in VARIANTS:
        assert f"| {variant} |" in table
    assert "## Grouped-query and multi-query attention" in table and "| 1 | MQA |" in table
    data = json.loads((tmp_path / "variants.json").read_text())
    assert len(data["rows"]) == 2 * len(VARIANTS)
    errors = {r["variant"]: r["error"] for r in data["rows"] if r["L"] == 128}
    for exact in ("math", "flash", "fused", "torch"):
        assert errors[exact] < 1e-5, errors  # same weights, exact attention
    assert (tmp_path / "variants.png").read_bytes()[:4] == b"\x89PNG"
    assert str(tmp_path) in capsys.readouterr().out


def test_causal_run_marks_linformer_not_applicable(tmp_path, one_thread):
    args = ["variants", "--quick", "--causal", "--backward", "--variants",
            "fused,sliding,linformer,performer", "--out", str(tmp_path)]
    assert main(args) == 0
    rows = json.loads((tmp_path / "variants.json").read_text())["rows"]
    lin = [r for r in rows if r["variant"] == "linformer"]
    assert all(r["fwd"]["error"] == "n/a: no causal form" for r in lin)
    slide = [r for r in rows if r["variant"] == "sliding"]
    assert all(r["fwd_bwd"]["seconds"] > 0 for r in slide)


def test_unknown_variant_is_an_error(tmp_path, capsys):
    assert main(["variants", "--quick", "--variants", "nope", "--out", str(tmp_path)]) == 2
    assert "--variants" in capsys.readouterr().err
