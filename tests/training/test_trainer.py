"""The trainer: learning happens, interrupted runs resume exactly, checkpoints are safe."""

import dataclasses
import json
import os
import signal

import pytest
import torch

from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.training.checkpoint import load_config, load_model, save_checkpoint
from attnlab.training.tasks.seq2seq import make_seq2seq_task
from attnlab.training.trainer import TrainConfig, Trainer, TrainingInterrupted


def tiny(task, dropout=0.1):
    cfg = TransformerConfig(
        len(task.src_vocab),
        len(task.tgt_vocab),
        d_model=16,
        num_heads=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        d_ff=32,
        dropout=dropout,
        max_len=32,
    )
    return Transformer(cfg)


def make_trainer(tmp_path, task, steps=12, on_step=None, dropout=0.1, **kw):
    torch.manual_seed(0)
    model = tiny(task, dropout)
    config = TrainConfig(
        steps=steps,
        batch_size=8,
        lr=3e-3,
        warmup=3,
        eval_every=5,
        checkpoint_every=4,
        log_every=1,
        **kw,
    )
    info = {
        "model_type": "transformer",
        "model_config": model.config.to_dict(),
        "extra": {"task": task.name},
    }
    return Trainer(
        model,
        task,
        config,
        out_dir=tmp_path,
        save_info=info,
        d_model=16,
        progress=False,
        on_step=on_step,
    )


@pytest.fixture(scope="module")
def task():
    t = make_seq2seq_task("reverse", max_len=5, n_test=20, n_valid=16)
    t.eval_examples = 8
    return t


def test_interrupted_run_resumes_to_the_same_final_loss(tmp_path, task):
    full = make_trainer(tmp_path / "full", task).fit()

    def interrupt(step, loss):
        if step == 7:
            os.kill(os.getpid(), signal.SIGINT)

    first = make_trainer(tmp_path / "cut", task, on_step=interrupt)
    with pytest.raises(TrainingInterrupted) as stop:
        first.fit()
    assert stop.value.step == 7 and stop.value.exit_code == 130
    assert json.loads((tmp_path / "cut" / "last" / "config.json").read_text())["format"]
    resumed = make_trainer(tmp_path / "cut", task)
    resumed.resume()
    assert resumed.step == 7
    result = resumed.fit()
    assert result.step == full.step == 12
    assert result.final_loss == full.final_loss  # bit for bit
    a, _ = load_model(tmp_path / "full" / "last")
    b, _ = load_model(tmp_path / "cut" / "last")
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n


def test_training_learns_and_logs_metrics(tmp_path, task):
    trainer = make_trainer(tmp_path, task, steps=30)
    result = trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0]
    assert any("valid_exact_match" in r for r in records)
    assert all("tokens_per_s" in r and "lr" in r for r in records if "loss" in r)
    assert (tmp_path / "best" / "model.safetensors").is_file()
    assert result.step == 30


@pytest.mark.filterwarnings("ignore:Seems like")
def test_grad_accumulation_equals_one_big_batch(tmp_path, task):
    a = make_trainer(tmp_path / "a", task, steps=3, grad_clip=None, dropout=0.0)
    b = make_trainer(tmp_path / "b", task, steps=3, grad_clip=None, grad_accum=2, dropout=0.0)
    # same global batch: accumulation draws micro-batches, so compare against its own pairs
    b.task = _AccumAsOne(task)
    a.task = _AccumAsOne(task, split=False)
    grads = {}
    for name, t in (("a", a), ("b", b)):
        # Compare the gradients the optimizer sees (Adam would magnify float noise in the
        # gradients that are zero in exact arithmetic, such as the key bias's).
        t.optimizer.step = lambda t=t, name=name: grads.setdefault(
            name, [p.grad.clone() for p in t.model.parameters()]
        )
        t.fit()
    for g, h in zip(grads["a"], grads["b"]):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)


class _AccumAsOne:
    """Serves the same 8 pairs per step, either whole or as two micro-batches of 4."""

    def __init__(self, task, split=True):
        self.task, self.split = task, split

    def batch(self, step, micro, size, rank, world):
        pairs = self.task.pairs(step, 0, 8)
        return self.task.encode(pairs[micro * 4 : (micro + 1) * 4] if self.split else pairs)

    def count(self, batch):
        return self.task.count(batch)

    def loss(self, model, batch):
        return self.task.loss(model, batch)

    def evaluate(self, model):
        return {}


def test_early_stopping(tmp_path, task):
    trainer = make_trainer(tmp_path, task, steps=100, patience=1)
    trainer.metric, trainer.higher_is_better = "never_better", True
    task_eval = trainer.task.evaluate
    trainer.task = _Constant(trainer.task, task_eval)
    result = trainer.fit()
    assert result.stopped_early and result.step == 10


class _Constant(_AccumAsOne):
    def __init__(self, task, _):
        super().__init__(task, split=False)

    def batch(self, step, micro, size, rank, world):
        return self.task.batch(step, micro, size, rank, world)

    def evaluate(self, model):
        return {"never_better": 0.0}


def test_checkpoint_errors_and_atomic_overwrite(tmp_path, task):
    model = tiny(task)
    info = {"model_type": "transformer", "model_config": model.config.to_dict()}
    ckpt = save_checkpoint(tmp_path / "ck", model, **info)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(tmp_path / "empty")
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_model(ckpt)
    # a config that does not match the weights
    save_checkpoint(tmp_path / "ck", model, **info)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model"]["d_ff"] = 64
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config does not match the weights.*linear1\.weight: "
                       r"\(32, 16\) in the file, \(64, 16\) from the config"):
        load_model(ckpt)

    # a failing save leaves the previous checkpoint in place
    save_checkpoint(tmp_path / "ck", model, **info)

    class Boom(torch.nn.Module):
        def state_dict(self, *a, **k):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path / "ck", Boom(), **info)
    load_model(ckpt)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(("info", "message"), [
    (None, r"missing \['model_type', 'model_config'\] in \[\]"),
    ({"model_type": "transformer"}, r"missing \['model_config'\]"),
    ({"model_type": "transformer", "model_config": {}, "vocab": 1}, r"unknown keys \['vocab'\]"),
])
def test_out_dir_without_usable_save_info_is_refused_before_training(tmp_path, info, message):
    task = make_seq2seq_task("copy", max_len=5, n_test=20, n_valid=16)
    model = Transformer(TransformerConfig(len(task.src_vocab), len(task.tgt_vocab), d_model=16,
                                          num_heads=2, num_encoder_layers=1,
                                          num_decoder_layers=1, d_ff=32))
    with pytest.raises(ValueError, match=r"^save_info: a run with out_dir saves checkpoints.*"
                                         + message):
        Trainer(model, task, TrainConfig(steps=3, batch_size=4, eval_every=3),
                out_dir=tmp_path, save_info=info, progress=False)
    assert not any(tmp_path.iterdir())
    with pytest.raises(TypeError, match=r"save_info: expected a dict .* got list"):
        Trainer(model, task, TrainConfig(steps=3, batch_size=4, eval_every=3),
                out_dir=tmp_path, save_info=["model_type", "model_config"], progress=False)


def test_close_frees_the_ddp_wrapper_and_fit_is_refused_after(tmp_path, task, monkeypatch):
    """A DistributedDataParallel wrapper that outlives ``destroy_process_group`` aborts the
    process at exit (gloo, about 1 run in 7): closing frees it."""
    import weakref

    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29400 + os.getpid() % 500))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with make_trainer(tmp_path, task, steps=1) as trainer:
            trainer.ddp = torch.nn.parallel.DistributedDataParallel(trainer.model)
            wrapper = weakref.ref(trainer.ddp)
            trainer.fit()
            assert wrapper() is not None
        assert wrapper() is None and trainer.ddp is None
        with pytest.raises(RuntimeError, match="fit: this Trainer is closed"):
            trainer.fit()
    finally:
        dist.destroy_process_group()


def test_the_progress_bar_shows_the_latest_evaluation_at_once(tmp_path, task, monkeypatch):
    """An evaluation's figure reaches the bar when it is measured, not at the next log line
    (with log_every=10 and eval_every=5 it would show only at step 10)."""
    from attnlab.training import trainer as trainer_module

    seen, runs = [], []

    class Bar(trainer_module.tqdm):
        def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
            seen.append((runs[0].step, dict(ordered_dict)))
            super().set_postfix(ordered_dict, refresh=refresh, **kwargs)

    monkeypatch.setattr(trainer_module, "tqdm", Bar)
    runs.append(make_trainer(tmp_path, task, steps=10))
    runs[0].config = dataclasses.replace(runs[0].config, log_every=10)
    runs[0].fit()
    metric = runs[0].metric
    evals = [r[metric] for r in runs[0].history if metric in r]
    step, shown = next((step, shown) for step, shown in seen if metric in shown)
    assert step == 5 and shown[metric] == f"{evals[0]:.4g}"
