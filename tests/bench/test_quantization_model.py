"""``attnlab bench quantization --model FOLDER``: quantized copies of a checkpoint scored
against it, every row of the module docstring in the written table."""

from __future__ import annotations

from attnlab.cli import main
from tiny_folders import make_folder

TEXT = "once upon a time there was a fox. the fox said hello to the world. " * 30


def test_a_folder_is_scored_row_by_row(tmp_path, capsys):
    folder, out = tmp_path / "model", tmp_path / "out"
    folder.mkdir()
    make_folder(folder)
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    assert main(["bench", "quantization", "--model", str(folder), "--text", str(text),
                 "--calibration", str(text), "--context", "64", "--group-sizes", "32",
                 "--quick", "--out", str(out), "--threads", "1"]) == 0
    lines = (out / "quantization-model.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| method"))
    assert "| KL mean | KL p99 | top-1 | decode tok/s |" in lines[header]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in lines[header + 2:] if line.startswith("|")]
    assert [r[:3] for r in rows] == [
        ["float", "float32", "-"], ["nearest", "int8", "row"],
        ["nearest", "int4, table int4", "32"], ["nearest", "int4, table int8", "32"],
        ["search", "int4, table int8", "32"], ["gptq", "int4, table int8", "32"]]
    assert rows[0][5:9] == ["-"] * 4  # the reference is not compared with itself
    for row in rows[1:]:
        assert float(row[6]) >= 0 and row[8].endswith("%") and float(row[9]) > 0
    assert all(r[3].endswith(" MiB") for r in rows)


def test_model_needs_a_text(tmp_path, capsys):
    assert main(["bench", "quantization", "--model", str(tmp_path), "--quick",
                 "--out", str(tmp_path / "out")]) == 2
    assert "--text: --model needs the text to score" in capsys.readouterr().err
