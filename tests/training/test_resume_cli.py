"""``--resume`` refuses what contradicts the saved run, never restarts silently, and resumes
exactly with early stopping and gradient accumulation; the train commands explain every
option, name bad flags, estimate the time and show the validation metric."""

import argparse
import json
import os
import re
import shutil
import signal

import pytest
import torch
from test_trainer import _Constant, make_trainer

from attnlab.cli import build_parser, main
from attnlab.training.checkpoint import load_model
from attnlab.training.trainer import TrainConfig, TrainingInterrupted

TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--no-progress"]


def seq2seq(out, *extra):
    return ["train", "seq2seq", "--task", "reverse", "--max-len", "4", "--steps", "2",
            "--batch-size", "8", "--eval-every", "1000", *TINY, "--out", str(out), *extra]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    assert main(seq2seq(out)) == 0
    return out


def test_resume_names_every_flag_that_contradicts_the_saved_run(finished, capsys):
    before = (finished / "last" / "config.json").read_text()
    args = [*seq2seq(finished, "--resume"), "--task", "copy", "--d-model", "32", "--lr", "0.01"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--task (saved 'reverse', given 'copy')" in err
    assert "--d-model (saved 16, given 32)" in err
    assert "--lr (saved 0.001, given 0.01)" in err
    assert "--steps" in err  # names what may change
    assert (finished / "last" / "config.json").read_text() == before


def test_resume_may_change_steps_eval_and_patience(finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    assert main([*seq2seq(out, "--resume"), "--steps", "3", "--eval-every", "7",
                 "--patience", "4", "--log-every", "1"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert json.loads((out / "last" / "trainer_state.json").read_text())["step"] == 3


def test_resume_without_a_run_refuses(tmp_path, capsys):
    assert main(seq2seq(tmp_path / "nothing", "--resume")) == 2
    assert "holds no run to resume" in capsys.readouterr().err
    assert not (tmp_path / "nothing").exists()


def test_a_new_run_refuses_a_folder_whose_checkpoint_is_hidden_by_a_crash(finished, tmp_path,
                                                                        capsys):
    out = tmp_path / "run"
    shutil.copytree(finished / "last", out / ".last.old")
    assert main(seq2seq(out)) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_resume_refuses_another_text(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("abcdefgh " * 20)
    b.write_text("abcdefgh " * 19 + "abcdefgi ")
    args = ["train", "lm", "--block-size", "8", "--steps", "1", "--batch-size", "2",
            "--eval-every", "1000", *TINY, "--out", str(tmp_path / "run")]
    assert main([*args, "--text", str(a)]) == 0
    assert main([*args, "--text", str(b), "--resume"]) == 2
    assert "--text (saved" in capsys.readouterr().err
    moved = tmp_path / "moved.txt"
    a.rename(moved)
    assert main([*args, "--text", str(moved), "--resume", "--steps", "2"]) == 0


def test_every_train_option_has_a_help_text():
    train = _subparser(build_parser(), "train")
    for kind in ("seq2seq", "lm"):
        for action in _subparser(train, kind)._actions:
            assert action.help and action.help != argparse.SUPPRESS, (kind, action.dest)


def _subparser(parser, name):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "argument --steps: expected a positive int, got '0'"),
        (["--grad-clip", "-1"], "argument --grad-clip: expected a finite number >= 0"),
        (["--patience", "0"], "argument --patience: expected a positive int"),
        (["--lr", "nan"], "argument --lr: expected a finite number > 0"),
        (["--max-len", "0"], "argument --max-len: expected a positive int"),
    ],
)
def test_bad_flags_are_named(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main([*seq2seq(tmp_path / "x"), *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_flag_combinations_are_named(tmp_path, capsys):
    assert main([*seq2seq(tmp_path / "x"), "--d-model", "10", "--heads", "3"]) == 2
    assert "--d-model: expected a multiple of --heads=3, got 10" in capsys.readouterr().err
    assert main([*seq2seq(tmp_path / "x"), "--grad-accum", "3"]) == 2
    assert "--batch-size: expected a multiple of --grad-accum=3, got 8" in \
        capsys.readouterr().err


def test_grad_clip_zero_means_no_clipping(tmp_path):
    # clip_grad_norm_(..., 0) multiplies every gradient by 0: nothing would be learned
    assert main(seq2seq(tmp_path / "run", "--grad-clip", "0")) == 0
    state = json.loads((tmp_path / "run" / "last" / "trainer_state.json").read_text())
    assert state["train_config"]["grad_clip"] is None
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="grad_clip: expected None or > 0"):
            TrainConfig(grad_clip=bad)
    with pytest.raises(ValueError, match="patience: expected a positive int, got 0"):
        TrainConfig(patience=0)


def test_time_estimate_before_training(tmp_path, capsys):
    assert main(seq2seq(tmp_path / "run")) == 0
    out = capsys.readouterr().out
    estimate = out.index("s/step, ~")
    assert out.startswith("about ") and " for 2 steps" in out
    assert estimate < out.index("reached step 2")
    # The last line's figures are formatted (it once printed best valid_loss 2.5465917587280273).
    assert re.search(r"reached step 2: loss \d+\.\d{4}, best valid_\w+ \d+\.\d{4}; outputs", out)


@pytest.fixture(scope="module")
def task():
    from attnlab.training.tasks.seq2seq import make_seq2seq_task

    t = make_seq2seq_task("reverse", max_len=5, n_test=20, n_valid=16)
    t.eval_examples = 8
    return t


def test_progress_bar_shows_the_validation_metric(tmp_path, task, capsys):
    trainer = make_trainer(tmp_path, task, steps=8)
    trainer.progress = True
    trainer.fit()
    assert "valid_loss=" in capsys.readouterr().err


def interrupt_at(step):
    def on_step(now, loss):
        if now == step:
            os.kill(os.getpid(), signal.SIGINT)

    return on_step


def test_early_stopping_resumes_to_the_same_stop(tmp_path, task):
    def constant(trainer):
        trainer.metric, trainer.higher_is_better = "never_better", True
        trainer.task = _Constant(trainer.task, None)
        return trainer

    full = constant(make_trainer(tmp_path / "full", task, steps=100, patience=1)).fit()
    assert full.stopped_early and full.step == 10
    cut = constant(make_trainer(tmp_path / "cut", task, steps=100, patience=1,
                                on_step=interrupt_at(7)))
    with pytest.raises(TrainingInterrupted):
        cut.fit()
    resumed = constant(make_trainer(tmp_path / "cut", task, steps=100, patience=1))
    resumed.resume()
    result = resumed.fit()
    assert result.stopped_early and result.step == 10 and result.final_loss == full.final_loss
    assert_same_weights(tmp_path / "full", tmp_path / "cut")
    again = constant(make_trainer(tmp_path / "cut", task, steps=100, patience=1))
    again.resume()
    result = again.fit()  # patience already spent: no more steps
    assert result.stopped_early and result.step == 10


def test_grad_accumulation_resumes_exactly(tmp_path, task):
    full = make_trainer(tmp_path / "full", task, steps=7, grad_accum=2).fit()
    with pytest.raises(TrainingInterrupted):
        make_trainer(tmp_path / "cut", task, steps=7, grad_accum=2,
                     on_step=interrupt_at(5)).fit()
    resumed = make_trainer(tmp_path / "cut", task, steps=7, grad_accum=2)
    resumed.resume()
    assert resumed.step == 5 and resumed.fit().final_loss == full.final_loss
    assert_same_weights(tmp_path / "full", tmp_path / "cut")
    lines = (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)]
    assert steps == list(range(1, 8))


def test_resume_refuses_other_options_in_the_python_api(tmp_path, task):
    with pytest.raises(TrainingInterrupted):
        make_trainer(tmp_path, task, on_step=interrupt_at(2)).fit()
    with pytest.raises(ValueError, match=r"grad_accum: saved 1, given 2.*may change"):
        make_trainer(tmp_path, task, grad_accum=2).resume()
    with pytest.raises(ValueError, match="holds no checkpoint 'last' to resume"):
        make_trainer(tmp_path / "empty", task).resume()


def test_metrics_past_the_resumed_step_and_torn_lines_are_dropped(tmp_path, task):
    with pytest.raises(TrainingInterrupted):
        make_trainer(tmp_path, task, on_step=interrupt_at(4)).fit()
    metrics = tmp_path / "metrics.jsonl"
    with open(metrics, "a") as f:  # a run that went on past its checkpoint, then was killed
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n" + '{"step": 6, "lo')
    resumed = make_trainer(tmp_path, task)
    resumed.resume()
    resumed.fit()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    loss_steps = [r["step"] for r in records if "loss" in r]
    assert loss_steps == list(range(1, 13))


def assert_same_weights(a, b):
    x, _ = load_model(a / "last")
    y, _ = load_model(b / "last")
    for (name, p), q in zip(x.state_dict().items(), y.state_dict().values()):
        assert torch.equal(p, q), name


def test_signal_handlers_live_only_while_fit_runs(tmp_path, task):
    def mine(signum, frame):
        pass

    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        make_trainer(tmp_path / "a", task, steps=2).fit()
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
        with pytest.raises(TrainingInterrupted):
            make_trainer(tmp_path / "b", task, on_step=interrupt_at(1)).fit()
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_second_signal_stops_at_once_without_saving(tmp_path, task):
    def twice(step, loss):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(KeyboardInterrupt) as stop:
        make_trainer(tmp_path, task, on_step=twice).fit()
    assert not isinstance(stop.value, TrainingInterrupted)
    assert not (tmp_path / "last").exists()  # the first checkpoint was due at step 4


def test_time_estimate_leaves_the_run_untouched(tmp_path, task):
    with pytest.raises(TrainingInterrupted):
        make_trainer(tmp_path / "a", task, steps=4, on_step=interrupt_at(2)).fit()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    plain = make_trainer(tmp_path / "a", task, steps=4)
    plain.resume()
    expected = plain.fit().final_loss
    timed = make_trainer(tmp_path / "b", task, steps=4)
    timed.resume()  # the restored RNG state must survive the estimate's dropout
    assert timed.estimate_step_seconds() > 0
    assert timed.fit().final_loss == expected
    assert_same_weights(tmp_path / "a", tmp_path / "b")
