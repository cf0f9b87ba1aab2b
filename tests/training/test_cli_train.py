"""The training commands end to end, and torchrun with two processes equal to one."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnlab.cli import main

TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--dropout", "0", "--no-progress"]


def test_train_translate_and_resume_refusal(tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        "seq2seq",
        "--task",
        "reverse",
        "--max-len",
        "4",
        "--steps",
        "4",
        "--batch-size",
        "8",
        "--eval-every",
        "2",
        "--out",
        str(out),
        *TINY,
    ]
    assert main(args) == 0
    assert (out / "last" / "model.safetensors").is_file() and (out / "metrics.jsonl").is_file()
    assert str(out) in capsys.readouterr().out
    assert main(args) == 2  # refuses to overwrite a run without --resume
    assert "--resume" in capsys.readouterr().err
    code = main(["translate", "--checkpoint", str(out / "last"), "123", "42"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["123", "42"]
    # A 4-step model's answers may be invalid: each is then an error line, exit status 1.
    assert code == (1 if any("\terror: " in line for line in lines) else 0)


def test_train_lm_and_sample(tmp_path, capsys):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    out = tmp_path / "lm"
    assert (
        main(
            [
                "train",
                "lm",
                "--text",
                str(text),
                "--block-size",
                "16",
                "--steps",
                "3",
                "--batch-size",
                "4",
                "--eval-every",
                "3",
                "--out",
                str(out),
                *TINY,
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        main(
            [
                "sample",
                "--checkpoint",
                str(out / "last"),
                "--prompt",
                "the ",
                "--max-new-tokens",
                "20",
            ]
        )
        == 0
    )
    sample = capsys.readouterr().out
    assert sample.startswith("the ") and len(sample) > 5


@pytest.mark.parametrize("content", ["", "   \n"])
def test_train_lm_rejects_empty_text(tmp_path, capsys, content):
    text = tmp_path / "empty.txt"
    text.write_text(content)
    assert main(["train", "lm", "--text", str(text), "--out", str(tmp_path / "x"), *TINY]) == 2
    assert "empty" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "lm",
                "--text",
                str(tmp_path / "missing.txt"),
                "--out",
                str(tmp_path / "y"),
                *TINY,
            ]
        )
        == 2
    )


def test_bad_checkpoint_folders(tmp_path, capsys):
    assert main(["translate", "--checkpoint", str(tmp_path / "nothing"), "x"]) == 2
    (tmp_path / "notours").mkdir()
    (tmp_path / "notours" / "config.json").write_text('{"model_type": "bert"}')
    assert main(["translate", "--checkpoint", str(tmp_path / "notours"), "x"]) == 2
    assert "not an attnlab checkpoint" in capsys.readouterr().err


def test_torchrun_two_processes_reach_the_same_parameters_as_one(tmp_path):
    common = [
        "train",
        "seq2seq",
        "--task",
        "copy",
        "--max-len",
        "5",
        "--steps",
        "3",
        "--batch-size",
        "8",
        "--eval-every",
        "3",
        "--grad-clip",
        "0",
        *TINY,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "attnlab",
    ]
    done = subprocess.run(
        [*launcher, *common, "--out", str(tmp_path / "two")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    two = load_file(Path(tmp_path / "two" / "last" / "model.safetensors"))
    one = load_file(Path(tmp_path / "one" / "last" / "model.safetensors"))
    assert two.keys() == one.keys()
    for name in one:
        a, b = two[name], one[name]
        if name.endswith("in_proj_bias"):
            # The key bias adds one amount to every score of a query, which softmax ignores:
            # its gradient is rounding noise (summed in another order by two processes), and
            # Adam's normalisation turns noise of either sign into steps of the learning
            # rate's size (an Intel Xeon: 1.5e-5 apart, the q and v parts 3e-11).
            E = b.numel() // 3
            a, b = torch.cat((a[:E], a[2 * E:])), torch.cat((b[:E], b[2 * E:]))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
