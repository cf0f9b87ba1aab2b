"""``attnlab train`` stopped by SIGINT, SIGTERM or SIGKILL at many moments (mid-forward,
after the optimizer step, during the save, between the two renames of the checkpoint swap,
while its files are written, or from outside at a random moment) and then resumed reaches,
bit for bit, the weights, trainer state and metrics of a run never interrupted.

The faults at chosen moments run in a forked process (a real process receiving real signals,
without the seconds of a fresh ``import torch``); the signals from outside go to a real
``python -m attnlab`` process.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import attnlab.durable as durable
import attnlab.training.checkpoint as checkpoint
from attnlab.cli import main
from attnlab.training.tasks.text import CharLMTask
from attnlab.training.trainer import Trainer

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Float sums depend on the thread count: every run here uses one, as the subprocess."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def run_args(corpus, out, steps=12, eval_every=4):
    return ["train", "lm", "--text", str(corpus), "--block-size", "16", "--steps", str(steps),
            "--batch-size", "8", "--eval-every", str(eval_every), "--log-every", "1",
            "--d-model", "16", "--layers", "1", "--heads", "2", "--dropout", "0.2",
            "--no-progress", "--out", str(out)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus, one_thread):
    """The uninterrupted run's outcome."""
    out = tmp_path_factory.mktemp("reference") / "run"
    assert main(run_args(corpus, out)) == 0
    return outcome(out)


@pytest.mark.parametrize(
    ("mode", "at", "code", "resumes_at"),
    [
        ("sigint-after-forward", 6, 130, 6),
        ("sigterm-after-optimizer-step", 3, 143, 3),
        ("second-sigterm-during-save", 8, 143, 8),
        ("sigkill-between-renames", 8, -9, 4),
        ("sigkill-mid-write", 8, -9, 4),
    ],
)
def test_stopped_run_resumes_bit_for_bit(tmp_path, corpus, reference, capfd, mode, at, code,
                                         resumes_at):
    out = tmp_path / "run"
    assert in_child(mode, at, run_args(corpus, out)) == code
    if code > 0:
        assert f"stopped after step {at}: checkpoint saved" in capfd.readouterr().err
    if mode == "sigkill-between-renames":
        # the kill came in the window where only the previous version exists, hidden
        assert not (out / "last").exists() and (out / ".last.old").is_dir()
    if mode == "sigkill-mid-write":
        assert any(p.name.startswith(".last.tmp-") for p in out.iterdir())
    assert main([*run_args(corpus, out), "--resume"]) == 0
    assert f"at step {resumes_at}\n" in capfd.readouterr().out
    assert outcome(out) == reference
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_resume_twice_and_after_finishing(tmp_path, corpus, reference, capfd):
    out = tmp_path / "run"
    assert in_child("sigint-after-forward", 2, run_args(corpus, out)) == 130
    assert in_child("sigint-after-forward", 7, [*run_args(corpus, out), "--resume"]) == 130
    assert saved_step(out) == 7
    assert main([*run_args(corpus, out), "--resume"]) == 0
    assert outcome(out) == reference
    capfd.readouterr()
    assert main([*run_args(corpus, out), "--resume"]) == 0  # finished: nothing to do
    assert "already at step 12" in capfd.readouterr().out
    assert outcome(out) == reference


@pytest.fixture(scope="module")
def long_reference(tmp_path_factory, corpus, one_thread):
    out = tmp_path_factory.mktemp("long") / "run"
    assert main(run_args(corpus, out, steps=150, eval_every=50)) == 0
    return outcome(out)


def test_sigterm_from_outside_at_a_random_moment(tmp_path, corpus, long_reference):
    sig = signal.SIGTERM  # what kill, timeout and job schedulers send
    out = tmp_path / "run"
    args = run_args(corpus, out, steps=150, eval_every=50)
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600  # hang guards
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + sig, err[-3000:]
    stopped = saved_step(out)
    assert 3 <= stopped < 150 and f"stopped after step {stopped}" in err
    assert main([*args, "--resume"]) == 0
    assert outcome(out) == long_reference


def in_child(mode, at, argv):
    """Run ``attnlab argv`` in a forked process with the fault ``mode`` at step ``at``;
    returns its exit status as ``subprocess`` gives it (-9: killed by SIGKILL)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            inject(mode, at)
            code = main(argv)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def inject(mode, at):
    """Patch the child so that ``mode`` happens at step ``at`` (the child exits after)."""
    me, now = os.getpid(), {"step": 0}

    def when(name, fault):
        if mode == name and now["step"] == at:
            fault()

    def wrap(owner, attr, after):
        original = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            after(*args)
            return result

        setattr(owner, attr, wrapper)

    def count(trainer):
        now["step"] = trainer.step + 1  # the step being computed

    original_step = Trainer._train_step
    Trainer._train_step = lambda self: (count(self), original_step(self))[1]
    wrap(CharLMTask, "loss", lambda *a: when("sigint-after-forward",
                                             lambda: os.kill(me, signal.SIGINT)))
    wrap(torch.optim.AdamW, "step", lambda *a: when("sigterm-after-optimizer-step",
                                                    lambda: os.kill(me, signal.SIGTERM)))
    if mode == "second-sigterm-during-save":
        wrap(Trainer, "_train_step", lambda *a: when(mode, lambda: os.kill(me, signal.SIGTERM)))
        wrap(checkpoint, "save_file", lambda *a: when(mode, lambda: os.kill(me, signal.SIGTERM)))
    wrap(checkpoint, "save_file", lambda tensors, path: "last" in path and when(
        "sigkill-mid-write", lambda: os.kill(me, signal.SIGKILL)))
    wrap(durable.os, "replace", lambda src, dst: str(dst).endswith(".last.old") and when(
        "sigkill-between-renames", lambda: os.kill(me, signal.SIGKILL)))


def saved_step(out):
    return json.loads((out / "last" / "trainer_state.json").read_text())["step"]


def outcome(out):
    """Everything a resumed run must reproduce: weights, trainer state, metric records."""
    weights = load_file(out / "last" / "model.safetensors")
    tensors = load_file(out / "last" / "trainer_state.safetensors")
    state = json.loads((out / "last" / "trainer_state.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("tokens_per_s", None)  # a timing
    return ({k: v.tolist() for k, v in weights.items()},
            {k: v.tolist() for k, v in tensors.items()}, state, records)


TORCHRUN_DRIVER = r"""
import os, signal, sys
from attnlab.cli import main
from attnlab.training.trainer import Trainer

if os.environ["RANK"] == "1":  # only rank 1 is signalled, during step 3
    train_step = Trainer._train_step
    def signalled(self):
        if self.step + 1 == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(self)
    Trainer._train_step = signalled
sys.exit(main(sys.argv[1:]))
"""


def test_torchrun_ranks_stop_together_and_save_every_ranks_rng(tmp_path, corpus, capsys):
    driver = tmp_path / "driver.py"
    driver.write_text(TORCHRUN_DRIVER)
    out = tmp_path / "run"
    args = run_args(corpus, out, steps=6, eval_every=100)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(driver), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=900,
    )
    assert done.returncode != 0
    assert "stopped after step 3: checkpoint saved" in done.stderr, done.stderr[-3000:]
    assert saved_step(out) == 3
    tensors = load_file(out / "last" / "trainer_state.safetensors")
    assert {"rng.torch.0", "rng.torch.1"} <= tensors.keys()
    assert not torch.equal(tensors["rng.torch.0"], tensors["rng.torch.1"])
    # an exact resume needs the same number of processes
    assert main([*args, "--resume"]) == 2
    assert "saved by 2 processes and is resumed by 1" in capsys.readouterr().err
