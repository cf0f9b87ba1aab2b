"""`attnlab bench families --quick`: one random checkpoint per family, ours vs transformers
from the same folder, with a ratio column per measure; bad family or dtype names are refused
by the flag."""

from __future__ import annotations

import json

import pytest

from attnlab.bench import versus
from attnlab.bench.families import QUICK
from attnlab.cli import main
from attnlab.models.families import FAMILIES
from devbench.cli import main as devbench_main


def test_bench_families_quick(tmp_path, one_thread, capsys) -> None:
    pytest.importorskip("transformers")
    assert main(["bench", "families", "--quick", "--dtypes", "float32", "--out",
                 str(tmp_path)]) == 0
    data = json.loads((tmp_path / "families.json").read_text())
    names = [f["model_type"] for f in data["families"]]
    assert sorted(names) == sorted({f.model_types[0] for f in FAMILIES.values()})
    table = (tmp_path / "families.md").read_text()
    assert "| prefill ratio |" in table and "| decode batched ratio |" in table
    for family in data["families"]:
        assert family["checkpoint"].startswith("transformers")
        (run,) = family["runs"]
        cells = [run["cells"][m] for m in versus.MEASURES]
        assert all(c["ours"] > 0 and c["transformers"] > 0 for c in cells)
        figures = " | ".join(f"{c['ours']:.1f} / {c['transformers']:.1f} "
                             f"| {c['ours'] / c['transformers']:.2f}x" for c in cells)
        shares = " | ".join(
            f"{100 * c['ours'] / c['bound']:.0f}% / {100 * c['transformers'] / c['bound']:.0f}%"
            for c in (run["cells"]["decode"], run["cells"]["decode batched"]))
        assert f"| {family['model_type']} | float32 | {figures} | {shares} |" in table
    assert "## History" not in table  # nothing was there before
    assert (tmp_path / "families.png").stat().st_size > 1000
    assert str(tmp_path) in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--families", "bert"], "argument --families: expected comma-separated model types "
                             f"among {sorted(FAMILIES)}"),
    (["--families", "llama,llama"], "each once, got 'llama,llama'"),
    (["--dtypes", "float16"], "argument --dtypes: expected comma-separated dtypes among "
                              "('float32', 'bfloat16'), each once, got 'float16'"),
    (["--dtypes", ""], "argument --dtypes: expected comma-separated dtypes"),
    (["--device", "cuda:7"], "argument --device:"),
])
def test_bench_families_bad_flags_are_refused_by_name(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "families", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["families", "qwen2"])
def test_an_out_that_is_a_file_fails_before_measuring(bench, tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    # families is attnlab bench's and devbench's, qwen2 devbench's only: both the same way.
    assert devbench_main([bench, "--quick", "--out", str(tmp_path / "file")]) == 2
    captured = capsys.readouterr()
    assert "File exists" in captured.err and "bench " not in captured.out


def test_without_transformers_ours_is_measured_from_our_own_checkpoint(tmp_path, monkeypatch,
                                                                       one_thread) -> None:
    monkeypatch.setattr(versus, "_transformers", lambda: None)
    assert main(["bench", "families", "--quick", "--families", "qwen2", "--dtypes",
                 "bfloat16", "--out", str(tmp_path)]) == 0
    (family,) = json.loads((tmp_path / "families.json").read_text())["families"]
    assert family["checkpoint"] == "attnlab.models.io.save_pretrained"
    (run,) = family["runs"]
    assert run["reference"] == "transformers is not installed: no reference measured"
    assert all(c["ours"] > 0 and c["transformers"] is None for c in run["cells"].values())
    assert "| qwen2 | bfloat16 |" in (tmp_path / "families.md").read_text()


def test_bench_families_measures_folders_given_with_model(tmp_path, one_thread) -> None:
    # The checkpoints a user has on disk: two folders of two families, each its own rows,
    # named by model type and folder, and the table says which folders it timed.
    pytest.importorskip("transformers")
    folders = []
    for model_type, name in (("llama", "my-llama"), ("gpt2", "small gpt")):
        folder, _ = versus.random_checkpoint(tmp_path / name, model_type, QUICK)
        folders.append(folder)
    out = tmp_path / "out"
    assert main(["bench", "families", "--quick", "--dtypes", "float32", "--model",
                 str(folders[0]), "--model", str(folders[1]), "--out", str(out)]) == 0
    data = json.loads((out / "families.json").read_text())
    assert data["folders"] is True and data["sizes"] is None
    assert [(f["model_type"], f["checkpoint"]) for f in data["families"]] == [
        ("llama", str(folders[0])), ("gpt2", str(folders[1]))]
    table = (out / "families.md").read_text()
    assert "| llama `my-llama` | float32 |" in table and "| gpt2 `small gpt` | float32 |" in table
    assert f"`{folders[0]}` (llama: 2 layers, hidden 64, 4 query / 2 key-value heads" in table
    assert "One random checkpoint" not in table
    assert f"attnlab bench families --model {folders[0]} --model '{folders[1]}'`" in table
    for family in data["families"]:
        (run,) = family["runs"]
        assert all(c["ours"] > 0 and c["transformers"] > 0 for c in run["cells"].values())


def test_bench_families_model_refuses_what_it_cannot_time(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "empty").mkdir()
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    short, _ = versus.random_checkpoint(tmp_path / "short", "qwen2",
                                        {**QUICK, "max_position_embeddings": 8})
    for argv, message in (
            (["--model", str(tmp_path / "missing")], "argument --model:"),
            (["--model", str(tmp_path / "empty")], "config.json"),
            (["--model", str(bert)], "model_type 'bert' is not supported; expected one of"),
            (["--model", str(short), "--families", "llama"], "not allowed with argument")):
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "families", *argv])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "argument --model" in err or "argument --families" in err
        assert message in err, err
    assert main(["bench", "families", "--quick", "--model", str(short), "--out",
                 str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert ("--prefill, --prompt, --new-tokens: the workload needs 16 positions, more than "
            f"the 8 of {short}") in captured.err
    assert "bench families:" not in captured.out  # refused before any timing
