"""``python -m devbench``: the benchmarks write their files (never over the committed tables
with --quick), keep a committed table's history, refuse bad values up front and record
out-of-memory."""

import json

import pytest
import torch

from devbench import attention, mha
from devbench.cli import main


def test_bench_mha_quick_writes_table_and_plot(tmp_path, one_thread, capsys):
    assert main(["mha", "--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "mha.md").read_text()
    assert "| 2 | 16 | train |" in table and "## Machine" in table
    assert (tmp_path / "mha.png").stat().st_size > 1000
    assert str(tmp_path) in capsys.readouterr().out


def test_bench_attention_quick_records_out_of_memory_at_a_length(tmp_path, monkeypatch,
                                                                 one_thread, capsys):
    real = attention._measure

    def measure(L, *args):  # the inputs of L=128 do not fit
        if L == 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real(L, *args)

    monkeypatch.setattr(attention, "_measure", measure)
    assert main(["attention", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "attention.json").read_text())["rows"]
    assert all(r["fwd"]["seconds"] > 0 and r["fwd_bwd"]["seconds"] > 0
               for r in rows if r["L"] == 64)
    oom = [r for r in rows if r["L"] == 128]
    assert len(oom) == 8 and all(r["fwd"]["error"] == r["fwd_bwd"]["error"] == "OOM" for r in oom)
    table = (tmp_path / "attention.md").read_text()
    assert "| 128 | yes | flash | OOM | — | OOM | — | OOM | OOM | — |" in table
    assert (tmp_path / "attention.png").stat().st_size > 1000
    assert str(tmp_path) in capsys.readouterr().out


def test_bench_attention_warms_up_before_its_first_cell(tmp_path, monkeypatch, one_thread):
    """The first peak measured in a process holds one-off allocations: a discarded warm-up
    call of the first length comes before the first cell, so memory does not fall as L grows;
    a --quick table says that it is one."""
    calls = []
    real = attention._measure

    def measure(L, causal, H, D, repeats, device):
        calls.append((L, causal, repeats))
        return real(L, causal, H, D, repeats, device)

    monkeypatch.setattr(attention, "_measure", measure)
    assert main(["attention", "--quick", "--out", str(tmp_path)]) == 0
    assert calls == [(64, False, 1), (64, False, 3), (64, True, 3), (128, False, 3),
                     (128, True, 3)]
    rows = json.loads((tmp_path / "attention.json").read_text())["rows"]
    assert len(rows) == 16  # the warm-up's rows are not in the table
    assert "**A `--quick` run**" in (tmp_path / "attention.md").read_text()


def test_bench_quick_leaves_the_committed_tables_alone(tmp_path, monkeypatch, one_thread,
                                                       capsys):
    monkeypatch.chdir(tmp_path)
    committed = tmp_path / "benchmarks" / "mha.md"
    committed.parent.mkdir()
    committed.write_text("the committed table")
    assert main(["mha", "--quick"]) == 0
    assert committed.read_text() == "the committed table"
    assert sorted(p.name for p in (tmp_path / "benchmarks").iterdir()) == ["mha.md"]
    written = tmp_path / "runs" / "bench-quick" / "mha.md"
    assert "| 2 | 16 | train |" in written.read_text()
    assert capsys.readouterr().out.endswith("results written to runs/bench-quick/mha.md\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["attention", "--lengths", "0,x"], "argument --lengths: expected comma-separated ints"),
        (["attention", "--lengths", "-64"], "argument --lengths: expected positive ints"),
        (["attention", "--heads", "0"], "argument --heads: expected a positive int, got '0'"),
        (["attention", "--repeats", "0"], "argument --repeats: expected a positive int, got '0'"),
        (["attention", "--device", "gpu"],
         "argument --device: expected a device such as cpu or cuda, got 'gpu'"),
        (["attention", "--device", "meta"], "argument --device: expected cpu or cuda, got 'meta'"),
        (["mha", "--embed-dim", "-512"],
         "argument --embed-dim: expected a positive int, got '-512'"),
        (["generate", "--prompt", "-1"], "argument --prompt: expected a positive int, got '-1'"),
        (["generate", "--contexts", ""], "argument --contexts: expected positive ints, got ''"),
        (["qwen2", "--batch", "1.5"], "argument --batch: expected a positive int, got '1.5'"),
        (["qwen2", "--threads", "0"], "argument --threads: expected a positive int, got '0'"),
        (["qwen2", "--dtypes", "float32,int8"],
         "argument --dtypes: expected comma-separated dtypes among ('float32', 'bfloat16')"),
        (["families", "--families", "bert"],
         "argument --families: expected comma-separated model types among"),
        (["variants", "--min-len", "0"], "argument --min-len: expected a positive int, got '0'"),
        (["variants", "--repeats", "0", "--quick"],
         "argument --repeats: expected a positive int, got '0'"),
    ],
)
def test_bench_bad_values_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["mha", "--embed-dim", "10", "--heads", "3"],
         "--embed-dim: expected a multiple of --heads=3, got 10"),
        (["variants", "--min-len", "1024", "--max-len", "512"],
         "--min-len: expected at most --max-len=512, got 1024"),
        (["variants", "--variants", ","], "--variants: expected at least one of"),
        (["qwen2", "--new-tokens", "1"], "--new-tokens: expected >= 2"),
        (["families", "--new-tokens", "1"], "--new-tokens: expected >= 2"),
    ],
)
def test_bench_inconsistent_values_are_clear_errors(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_bench_mha_records_out_of_memory_as_a_result(tmp_path, monkeypatch, one_thread):
    real_step, real_time = mha._step, mha.time_medians
    length = []

    def step(name, module, x, mode):  # note the row's length
        length.append(x.shape[1])
        return real_step(name, module, x, mode)

    def time_medians(steps, **kwargs):
        if length[-1] == 64:
            raise torch.OutOfMemoryError("out of memory")
        return real_time(steps, **kwargs)

    monkeypatch.setattr(mha, "_step", step)
    monkeypatch.setattr(mha, "time_medians", time_medians)
    assert main(["mha", "--quick", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "mha.json").read_text())["rows"]
    assert [(r["L"], r["error"]) for r in rows] == [(16, None)] * 2 + [(64, "OOM")] * 2
    table = (tmp_path / "mha.md").read_text()
    assert "| 1 | 64 | train | OOM | OOM | — |" in table
