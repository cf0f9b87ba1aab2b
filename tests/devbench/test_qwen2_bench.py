"""`python -m devbench qwen2 --quick`: ours vs transformers from the same folder, float32 and
bfloat16, one prompt and a batch, with ratios and the bandwidth bound; the runs already in the
table stay below as history; out-of-memory is a result."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from attnlab.bench import versus
from devbench.cli import main

COMMITTED = Path(__file__).parents[2] / "benchmarks" / "qwen2.md"


def test_bench_qwen2_quick(tmp_path, one_thread, capsys) -> None:
    pytest.importorskip("transformers")
    shutil.copy(COMMITTED, tmp_path / "qwen2.md")  # an earlier run, to be kept as history
    old = COMMITTED.read_text()
    assert main(["qwen2", "--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "qwen2.md").read_text()
    current, history = table.split("\n## History\n")
    assert "| dtype | measure | ours tokens/s | transformers tokens/s | ours / transformers |" \
        in current
    data = json.loads((tmp_path / "qwen2.json").read_text())
    assert [run["dtype"] for run in data["runs"]] == ["float32", "bfloat16"]
    for run in data["runs"]:
        assert list(run["cells"]) == list(versus.MEASURES)
        for measure, cell in run["cells"].items():
            assert cell["ours"] > 0 and cell["transformers"] > 0, (run["dtype"], measure)
            row = (f"| {run['dtype']} | {measure} | {cell['ours']:.1f} "
                   f"| {cell['transformers']:.1f} | {cell['ours'] / cell['transformers']:.2f}x |")
            assert row in current
            assert ("bound" in cell) == measure.startswith("decode")
            if measure.startswith("decode"):  # its own bandwidth, timed beside it
                assert cell["bound"] == pytest.approx(
                    cell["rows"] * cell["bandwidth_gbs"] * 1e9 / run["weight_bytes"])
        assert run["cells"]["decode batched"]["rows"] == 4
    cells = [c for run in data["runs"] for c in run["cells"].values() if "bound" in c]
    low = min(c["bandwidth_gbs"] for c in cells)
    high = max(c["bandwidth_gbs"] for c in cells)
    assert f"timed in turns with the cell's runs: {low:.1f}-{high:.1f} GB/s" in current
    assert 0 <= data["agreement"] <= 1 and "Next-token agreement" in current
    assert f"- cpu: {data['machine']['cpu']}" in current
    # The committed run is kept below, headed by its machine, its headings two levels down.
    committed_cpu = json.loads(COMMITTED.with_suffix(".json").read_text())["machine"]["cpu"]
    assert history.lstrip().startswith(f"### {committed_cpu}, ")
    assert "#### Machine" in history and "# Qwen2" not in history
    assert old.split("\n## History\n")[0].splitlines()[2] in history
    assert (tmp_path / "qwen2.png").stat().st_size > 1000
    assert str(tmp_path) in capsys.readouterr().out


def test_bench_qwen2_records_out_of_memory_as_a_result(tmp_path, monkeypatch,
                                                       one_thread) -> None:
    """Our prefill runs out of memory: its cells say OOM, the reference's are measured."""
    pytest.importorskip("transformers")
    real = versus._ours_runner

    def ours_runner(model, ids, mask):
        _, gen = real(model, ids, mask)

        def out_of_memory():
            raise torch.OutOfMemoryError("out of memory")

        return out_of_memory, gen

    monkeypatch.setattr(versus, "_ours_runner", ours_runner)
    assert main(["qwen2", "--quick", "--dtypes", "float32", "--out",
                 str(tmp_path)]) == 0
    cells = json.loads((tmp_path / "qwen2.json").read_text())["runs"][0]["cells"]
    for measure in ("prefill", "prefill batched"):
        assert cells[measure]["ours"] is None and cells[measure]["ours_error"] == "OOM"
        assert cells[measure]["transformers"] > 0
    assert cells["decode"]["ours"] > 0
    table = (tmp_path / "qwen2.md").read_text()
    assert re.search(r"\| float32 \| prefill \| OOM \| [\d.]+ \| — \| — \| — \| — \|", table)


def test_bench_qwen2_without_reference(tmp_path, one_thread) -> None:
    assert main(["qwen2", "--quick", "--no-reference", "--dtypes", "bfloat16",
                 "--out", str(tmp_path)]) == 0
    cells = json.loads((tmp_path / "qwen2.json").read_text())["runs"][0]["cells"]
    assert all(c["ours"] > 0 and c["transformers"] is None for c in cells.values())
    assert "skipped (--no-reference)" in (tmp_path / "qwen2.md").read_text()


def test_bench_qwen2_extra_memory_loads_ours_with_packed_copies(tmp_path, one_thread,
                                                                 monkeypatch) -> None:
    pytest.importorskip("transformers")
    seen = []
    real = versus.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("extra_memory"))
        return real(*args, **kwargs)

    monkeypatch.setattr(versus, "from_pretrained", spy)
    argv = ["qwen2", "--quick", "--dtypes", "bfloat16", "--extra-memory",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    assert seen == [True]
    table = (tmp_path / "qwen2.md").read_text()
    assert "extra_memory=True" in table and "`python -m devbench qwen2 --extra-memory`" in table
