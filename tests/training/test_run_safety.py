"""A run folder in trouble: a second run on it is refused naming the first's process, a full
disk ends in one line naming the intact previous checkpoint, a NaN loss stops the run naming
the step (or is skipped on request) and never becomes the best, and what is written follows
the user's umask."""

import errno
import json
import math
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import make_trainer

import attnlab.training.checkpoint as checkpoint_module
from attnlab.cli import main
from attnlab.durable import write_text_atomic
from attnlab.training.checkpoint import load_trainer_state, save_checkpoint
from attnlab.training.run_lock import LOCK_NAME, RunFolderBusyError, RunLock
from attnlab.training.tasks.seq2seq import make_seq2seq_task
from attnlab.training.trainer import NonFiniteLossError, TrainConfig

TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--no-progress", "--threads", "1"]
SRC = str(Path(__file__).resolve().parents[2] / "src")


def seq2seq(out, *extra):
    return ["train", "seq2seq", "--task", "reverse", "--max-len", "4", "--batch-size", "8",
            *TINY, "--out", str(out), *extra]


@pytest.fixture(scope="module")
def task():
    t = make_seq2seq_task("reverse", max_len=5, n_test=20, n_valid=16)
    t.eval_examples = 8
    return t


def test_a_second_run_on_a_folder_is_refused_naming_the_first_and_a_killed_one_frees_it(
        tmp_path, capsys):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-m", "attnlab", *seq2seq(out, "--steps", "1000000",
                                                   "--eval-every", "1000000")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        # The time estimate is printed once the folder is locked (an event, not a time).
        line = first.stdout.readline()
        assert "s/step" in line, line
        assert main(seq2seq(out, "--steps", "1", "--eval-every", "1")) == 2
        err = capsys.readouterr().err
        assert f"is in use by another training run (process {first.pid} holds" in err
        assert not (out / "last").exists()  # the refused run wrote nothing
    finally:
        first.send_signal(signal.SIGKILL)  # no clean-up runs: the kernel drops the lock
        first.wait(timeout=120)
    assert main(seq2seq(out, "--steps", "1", "--eval-every", "1")) == 0
    assert load_trainer_state(out / "last").step == 1
    assert (out / LOCK_NAME).read_text().strip() == str(os.getpid())


def test_the_lock_is_released_on_exit_and_refused_while_held(tmp_path):
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunFolderBusyError, match=rf"process {os.getpid()} holds") as held:
            RunLock(tmp_path / "run").__enter__()
        assert held.value.pid == os.getpid()
    with RunLock(tmp_path / "run"):  # released: taken again at once
        pass


def test_a_full_disk_ends_in_one_line_naming_the_intact_checkpoint(tmp_path, capsys,
                                                                    monkeypatch):
    real_save = checkpoint_module.save_file
    saves_of_last = []

    def disk_full_on_the_second_last(tensors, path):
        if ".last.tmp-" in str(path):
            saves_of_last.append(path)
            if len(saves_of_last) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(tensors, path)

    monkeypatch.setattr(checkpoint_module, "save_file", disk_full_on_the_second_last)
    out = tmp_path / "run"
    assert main(seq2seq(out, "--steps", "4", "--eval-every", "2")) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "No space left on device" in lines[0]
    assert (f"the previous checkpoint {str(out / 'last')!r} of step 2 is intact" in lines[0])
    assert load_trainer_state(out / "last").step == 2
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


class _NanAt:
    """``task`` whose training loss is NaN at the given steps (1-based; one micro-batch)."""

    def __init__(self, task, bad_steps, evaluate_nan=False):
        self.task, self.bad_steps, self.evaluate_nan = task, bad_steps, evaluate_nan
        self.src_vocab, self.tgt_vocab, self.name = task.src_vocab, task.tgt_vocab, task.name
        self.step = 0

    def batch(self, step, micro, size, rank, world):
        self.step = step + 1
        return self.task.batch(step, micro, size, rank, world)

    def count(self, batch):
        return self.task.count(batch)

    def loss(self, model, batch):
        loss = self.task.loss(model, batch)
        return loss * math.nan if self.step in self.bad_steps else loss

    def evaluate(self, model):
        metrics = self.task.evaluate(model)
        return {**metrics, "valid_loss": math.nan} if self.evaluate_nan else metrics


def test_a_nan_loss_stops_the_run_naming_the_step_before_the_weights_change(tmp_path, task):
    weights = {}

    def keep(step, loss):
        weights[step] = [p.detach().clone() for p in trainer.model.parameters()]

    trainer = make_trainer(tmp_path, _NanAt(task, {6}), steps=8, on_step=keep)
    with pytest.raises(NonFiniteLossError, match=r"the loss is nan at step 6; stopped before "
                       r"applying it \(the checkpoint '.*last' of step 4 is intact\)") as stop:
        trainer.fit()
    assert stop.value.step == 6 and trainer.step == 5
    for now, before in zip(trainer.model.parameters(), weights[5], strict=True):
        assert torch.equal(now, before)
    assert load_trainer_state(tmp_path / "last").step == 4


def test_skip_nonfinite_skips_the_step_and_records_it(tmp_path, task):
    trainer = make_trainer(tmp_path, _NanAt(task, {3}), steps=6, skip_nonfinite=True)
    result = trainer.fit()
    assert result.step == 6 and math.isfinite(result.final_loss)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step3 = [r for r in records if r["step"] == 3 and "lr" in r]
    assert step3 == [{**step3[0], "loss": None, "skipped": True}]
    assert all("skipped" not in r for r in records if r["step"] != 3)


def test_a_nan_metric_never_becomes_the_best(tmp_path, task):
    trainer = make_trainer(tmp_path, _NanAt(task, set(), evaluate_nan=True), steps=5)
    assert trainer.fit().best_metric is None
    assert not (tmp_path / "best").exists()
    assert load_trainer_state(tmp_path / "last").best is None


@pytest.mark.parametrize(("mask", "folder_mode", "file_mode"),
                         [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_checkpoints_follow_the_users_umask(tmp_path, task, mask, folder_mode, file_mode):
    previous = os.umask(mask)
    try:
        make_trainer(tmp_path / "run", task, steps=4).fit()
        write_text_atomic(tmp_path / "note.txt", "x")
        save_checkpoint(tmp_path / "weights", torch.nn.Linear(2, 2), model_type="x",
                        model_config={})
    finally:
        os.umask(previous)
    folders = [tmp_path / "run" / "last", tmp_path / "run" / "best", tmp_path / "weights"]
    for folder in folders:
        assert stat.S_IMODE(folder.stat().st_mode) == folder_mode, folder
        for path in folder.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == file_mode, path
    assert {p.name for p in (tmp_path / "run" / "last").iterdir()} >= {
        "model.safetensors", "config.json", "trainer_state.safetensors", "trainer_state.json"}
    assert stat.S_IMODE((tmp_path / "note.txt").stat().st_mode) == file_mode


def test_skip_nonfinite_may_change_on_resume(tmp_path, task):
    make_trainer(tmp_path, task, steps=4).fit()
    trainer = make_trainer(tmp_path, task, steps=6, skip_nonfinite=True)
    trainer.resume()
    assert trainer.step == 4 and TrainConfig(skip_nonfinite=True).skip_nonfinite
