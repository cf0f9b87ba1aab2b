"""A plain, readable training loop: AdamW, warmup schedules, clipping, accumulation, bf16
autocast, periodic evaluation with early stopping, checkpoints with exact resume, JSON-lines
metrics, and DistributedDataParallel when launched by ``torchrun``.

The data of step ``s`` is a pure function of ``(seed, s)`` (``Task.batch``), so resuming
needs no data-loader state: model, optimizer, step and RNG states are enough (the schedule is
a function of the step). Under ``torchrun`` every rank computes its own shard of the same
global batch, and the loss is normalised by the global token count, so N processes reach the
same parameters as one.

Checkpoints are written only at step boundaries: SIGINT and SIGTERM ask the loop to stop, it
finishes the step, saves ``last`` and raises ``TrainingInterrupted``; every rank stops at the
same step. So a resumed run reaches, bit for bit, the weights and loss of an uninterrupted one.

A step whose loss (or clipped gradient norm) is not finite stops the run before the optimizer
moves (``NonFiniteLossError``, naming the step), or with ``skip_nonfinite`` is skipped (no
update; the schedule and the data move on; ``metrics.jsonl`` marks it ``"skipped": true``).
A checkpoint that cannot be written (a full disk) raises an ``OSError`` in one sentence naming
the previous checkpoint, which is intact.
"""

from __future__ import annotations

import copy
import gc
import math
import random
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import Tensor, nn
from tqdm import tqdm

from attnlab._checks import check_positive
from attnlab.models.config import ConfigMixin
from attnlab.training.checkpoint import (
    check_current_layout,
    checkpoint_folder,
    load_trainer_state,
    load_weights,
    save_checkpoint,
)
from attnlab.training.interrupt import StopRequests, TrainingInterrupted
from attnlab.training.metrics_log import append_record, drop_records_after
from attnlab.training.schedules import make_schedule
from attnlab.training.trainer_state import TrainerState, check_resumable, checked_optimizer_state

__all__ = ["RESUMABLE_CHANGES", "NonFiniteLossError", "Task", "TrainConfig", "TrainResult",
           "Trainer", "TrainingInterrupted"]

# TrainConfig fields that a resumed run may change: none of them alters the steps' arithmetic
# (a longer ``steps`` stretches the schedule from the resumed step on; ``skip_nonfinite``
# acts only on a step that would otherwise stop the run).
RESUMABLE_CHANGES = ("steps", "eval_every", "checkpoint_every", "log_every", "patience",
                     "skip_nonfinite")


@dataclass(frozen=True)
class TrainConfig(ConfigMixin):
    """Options of a training run (serialisable to JSON). ``skip_nonfinite``: skip a step
    whose loss or gradient norm is NaN or infinite instead of stopping the run."""

    steps: int = 2000
    batch_size: int = 64
    lr: float = 1e-3
    schedule: str = "cosine"
    warmup: int = 100
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float | None = 1.0
    grad_accum: int = 1
    bf16: bool = False
    eval_every: int = 200
    patience: int | None = None
    checkpoint_every: int = 500
    log_every: int = 10
    seed: int = 0
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "batch_size",
            "grad_accum",
            "eval_every",
            "checkpoint_every",
            "log_every",
        ):
            value = getattr(self, name)
            check_positive(name, value)
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"batch_size: expected a multiple of grad_accum={self.grad_accum}, "
                f"got {self.batch_size}"
            )
        if not self.lr > 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            # clip_grad_norm_ would scale the gradients by 0 or flip their sign
            raise ValueError(f"grad_clip: expected None or > 0, got {self.grad_clip}")
        if self.patience is not None:
            check_positive("patience", self.patience)


class NonFiniteLossError(ValueError):
    """A training step gave a NaN or infinite loss or gradient norm; the run stopped before
    the optimizer applied it. ``step`` is that step (1-based, as in ``metrics.jsonl``)."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class Task(Protocol):
    """What the trainer needs from a task."""

    def batch(self, step: int, micro: int, size: int, rank: int, world: int) -> Any:
        """Rows ``rank::world`` of the global micro-batch ``micro`` of ``step`` (``size`` rows);
        the batch has a ``to(device)`` method."""

    def count(self, batch: Any) -> int:
        """Number of target tokens in ``batch``."""

    def loss(self, model: nn.Module, batch: Any) -> Tensor:
        """Sum of the per-token losses of ``batch`` (a scalar)."""

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Validation metrics (the model is in eval mode, gradients off)."""


@dataclass
class TrainResult:
    step: int
    final_loss: float
    best_metric: float | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False


class Trainer:
    """Train ``model`` on ``task``; checkpoints and ``metrics.jsonl`` go into ``out_dir``.

    ``metric`` names the entry of ``task.evaluate`` used for early stopping and for the best
    checkpoint; ``higher_is_better`` gives its direction. ``save_info`` is stored in the
    checkpoint's config (model type and config, vocabularies: what rebuilds the model).
    ``on_step(step, loss)`` is called after each optimizer step.

    Under ``torchrun``, ``close()`` the trainer (or use it as a context manager) before
    ``cleanup_distributed()``: see ``close``.
    """

    def __init__(
        self,
        model: nn.Module,
        task: Task,
        config: TrainConfig,
        *,
        out_dir: str | Path | None = None,
        save_info: dict[str, Any] | None = None,
        metric: str = "valid_loss",
        higher_is_better: bool = False,
        d_model: int = 512,
        progress: bool = True,
        on_step: Callable[[int, float], None] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.task, self.config = task, config
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.save_info = save_info or {}
        if self.out_dir is not None:
            _check_save_info(self.save_info)
        self.metric, self.higher_is_better = metric, higher_is_better
        self.progress, self.on_step = progress, on_step
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.ddp = None
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.schedule = make_schedule(
            config.schedule,
            lr=config.lr,
            warmup=config.warmup,
            total_steps=config.steps,
            d_model=d_model,
        )
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=1.0,
            betas=config.betas,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule.lr_at)
        self.step = 0
        self.best: float | None = None
        self.bad_evals = 0
        self.last_loss: float | None = None
        self.last_eval: dict[str, float] = {}
        self.saved_step: int | None = None  # the step of the checkpoint ``last`` on disk
        self.history: list[dict[str, Any]] = []
        self._stops = StopRequests()
        self._closed = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Release the ``DistributedDataParallel`` wrapper, and with it its hold on the process
        group; ``fit`` refuses to run afterwards. Call it before ``destroy_process_group``:
        with torch 2.13 and gloo, a wrapper that outlives the group aborts the process at exit
        in about 1 run in 7 ("terminate called without an active exception")."""
        self.ddp = None
        self._closed = True
        gc.collect()  # a wrapper can sit in reference cycles (seen after a backward)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def resume(self) -> None:
        """Restore the run saved in ``out_dir/last`` to the step boundary where it was saved.

        Raises a ``ValueError`` when there is nothing to resume (no checkpoint, a weights-only
        one, the pickled format of older versions), when a saved file is damaged, or when the
        saved run's options differ from ``config`` other than in ``RESUMABLE_CHANGES``.
        """
        if self.out_dir is None:
            raise ValueError("out_dir: resuming needs the run folder, got None")
        folder = checkpoint_folder(self.out_dir / "last")
        if folder is None:
            raise ValueError(f"resume: {str(self.out_dir)!r} holds no checkpoint 'last' to "
                             "resume; start a new run instead")
        state = load_trainer_state(folder)
        if state is None:
            raise ValueError(f"resume: {str(folder)!r} holds weights only, no trainer state; "
                             "it cannot be resumed")
        check_current_layout(folder)  # before the optimizer state, which follows the names
        check_resumable(state, self.config.to_dict(), RESUMABLE_CHANGES, self.world, folder)
        optimizer_state = checked_optimizer_state(state, self.optimizer, folder)
        load_weights(folder, self.model)
        groups = self.optimizer.state_dict()["param_groups"]  # hyper-parameters: from config
        self.optimizer.load_state_dict({"state": optimizer_state, "param_groups": groups})
        if state.step > 0:
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, self.schedule.lr_at, last_epoch=state.step - 1
            )
        self.step, self.best, self.bad_evals = state.step, state.best, state.bad_evals
        self.saved_step = state.step
        self.last_loss = state.loss
        torch.set_rng_state(state.torch_rng[self.rank])
        if state.cuda_rng:
            torch.cuda.set_rng_state(state.cuda_rng[self.rank], self.device)
        random.setstate(state.python_rng)

    def estimate_step_seconds(self) -> float:
        """Seconds a training step takes here: forward and backward of the next step's batch
        on a copy of the model (the second of two runs, the first warms up). The run itself,
        its RNG states included, is untouched."""
        c = self.config
        model = copy.deepcopy(self.model).train()
        batches = [
            self.task.batch(self.step, m, c.batch_size // c.grad_accum, self.rank, self.world)
            .to(self.device)
            for m in range(c.grad_accum)
        ]
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            for _ in range(2):
                start = time.perf_counter()
                for batch in batches:
                    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=c.bf16):
                        self.task.loss(model, batch).backward()
                if cuda:
                    torch.cuda.synchronize(self.device)
                seconds = time.perf_counter() - start
        return seconds

    def fit(self) -> TrainResult:
        """Run until ``config.steps`` or early stopping. On SIGINT or SIGTERM: finish the step,
        save ``last`` and raise ``TrainingInterrupted`` (a ``KeyboardInterrupt``)."""
        if self._closed:
            raise RuntimeError("fit: this Trainer is closed (its DistributedDataParallel wrapper "
                               "was released); make a new Trainer to train further")
        c = self.config
        if self.step == 0:
            # dropout, and a task's own use of ``random``; a resumed run restores both
            torch.manual_seed(c.seed + self.rank)
            random.seed(c.seed + self.rank)
        if self.is_main and self.out_dir is not None:
            drop_records_after(self.out_dir / "metrics.jsonl", self.step)
        bar = tqdm(
            total=c.steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=not (self.progress and self.is_main),
            dynamic_ncols=True,
        )
        stopped = c.patience is not None and self.bad_evals >= c.patience
        tokens, t0 = 0, time.perf_counter()
        shown: dict[str, str] = {}  # the bar's figures: the latest log's and evaluation's
        self._stops = StopRequests()
        try:
            with self._stops:
                while self.step < c.steps and not stopped:
                    loss, n_tokens = self._train_step()
                    self.step += 1
                    tokens += n_tokens
                    skipped = not math.isfinite(loss)
                    if not skipped:
                        self.last_loss = loss
                    elif self.is_main:
                        bar.write(f"step {self.step}: non-finite loss or gradient norm; step "
                                  "skipped (skip_nonfinite)", file=sys.stderr)
                    if self.on_step is not None:
                        self.on_step(self.step, loss)
                    if self.step % c.log_every == 0 or self.step == c.steps:
                        rate = tokens / max(time.perf_counter() - t0, 1e-9)
                        lr = self.scheduler.get_last_lr()[0]
                        record = {"step": self.step, "loss": None if skipped else loss, "lr": lr,
                                  "tokens_per_s": rate}
                        self._log({**record, "skipped": True} if skipped else record)
                        shown = self._postfix(lr, rate)
                        bar.set_postfix(shown, refresh=False)
                        tokens, t0 = 0, time.perf_counter()
                    bar.update(1)
                    if self.step % c.eval_every == 0 or self.step == c.steps:
                        stopped = self._evaluate()
                        if self.metric in self.last_eval:  # shown now, not at the next log
                            shown[self.metric] = _figure(self.last_eval[self.metric])
                            bar.set_postfix(shown, refresh=False)
                    due = self.step % c.checkpoint_every == 0 or self.step == c.steps or stopped
                    if due:
                        self._save_last()
                    signum = self._agreed_stop()
                    if signum:
                        if not due:
                            self._save_last()
                        if self.world > 1:
                            dist.barrier()  # rank 0 has saved before any rank exits
                        saved = None if self.out_dir is None else self.out_dir / "last"
                        raise TrainingInterrupted(signum, self.step, saved)
        finally:
            bar.close()
        loss = math.nan if self.last_loss is None else self.last_loss
        return TrainResult(self.step, loss, self.best, self.history, stopped)

    def _train_step(self) -> tuple[float, int]:
        c = self.config
        module = self.ddp or self.model
        module.train()
        micro_size = c.batch_size // c.grad_accum
        batches = [
            self.task.batch(self.step, m, micro_size, self.rank, self.world).to(self.device)
            for m in range(c.grad_accum)
        ]
        local_tokens = sum(self.task.count(b) for b in batches)
        total = torch.tensor(float(local_tokens), device=self.device)
        if self.world > 1:
            dist.all_reduce(total)
        # Sum of token losses over the global batch / its token count; DDP averages over ranks,
        # hence the factor world.
        scale = self.world / max(total.item(), 1.0)
        running = 0.0
        for m, batch in enumerate(batches):
            sync = self.ddp is None or m == len(batches) - 1
            ctx = self.ddp.no_sync() if not sync else nullcontext()
            with ctx, torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=c.bf16):
                loss_sum = self.task.loss(module, batch)
                (loss_sum * scale).backward()
            running += loss_sum.item()
        # The global mean loss and the gradient norm are the same on every rank, so every
        # rank takes the same decision on a non-finite step, before the optimizer moves.
        mean = torch.tensor([running, float(local_tokens)], device=self.device)
        if self.world > 1:
            dist.all_reduce(mean)
        loss, tokens = (mean[0] / mean[1].clamp_min(1)).item(), int(mean[1].item())
        norm = 0.0
        if c.grad_clip is not None:
            norm = nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip).item()
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            if not c.skip_nonfinite:
                raise self._non_finite(loss, norm)
            self.scheduler.step()  # the learning rate stays a function of the step
            return math.nan, tokens
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss, tokens

    def _non_finite(self, loss: float, norm: float) -> NonFiniteLossError:
        step = self.step + 1
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {norm}"
        kept = "no checkpoint 'last' was saved"
        if self.out_dir is not None and self.saved_step is not None:
            kept = f"the checkpoint {str(self.out_dir / 'last')!r} of step {self.saved_step} " \
                   "is intact"
        return NonFiniteLossError(
            f"training: the {what} at step {step}; stopped before applying it ({kept}). Lower "
            "the learning rate, or set skip_nonfinite (--skip-nonfinite) to skip such steps",
            step)

    def _evaluate(self) -> bool:
        """Evaluate on rank 0; returns whether to stop early (agreed by every rank)."""
        stop = torch.zeros(1, device=self.device)
        if self.is_main:
            self.model.eval()
            with torch.no_grad():
                metrics = self.task.evaluate(self.model)
            self._log({"step": self.step, **metrics})
            self.last_eval = metrics
            value = metrics.get(self.metric)
            if value is not None:
                # A NaN is never better: saved as best, no later value would improve on it.
                better = math.isfinite(value) and (self.best is None or (
                    value > self.best if self.higher_is_better else value < self.best))
                if better:
                    self.best, self.bad_evals = value, 0
                    self._save("best")
                else:
                    self.bad_evals += 1
                patience = self.config.patience
                stop[0] = float(patience is not None and self.bad_evals >= patience)
        if self.world > 1:
            dist.broadcast(stop, src=0)
        return bool(stop.item())

    def _save_last(self) -> None:
        """Save ``last`` with the trainer state; every rank takes part (RNG states)."""
        torch_rng = self._gather(torch.get_rng_state())
        cuda_rng = ()
        if self.device.type == "cuda":
            cuda_rng = self._gather(torch.cuda.get_rng_state(self.device))
        state = TrainerState(
            step=self.step,
            best=self.best,
            bad_evals=self.bad_evals,
            loss=self.last_loss,
            train_config=self.config.to_dict(),
            optimizer=self.optimizer.state_dict()["state"],
            torch_rng=torch_rng,
            cuda_rng=cuda_rng,
            python_rng=random.getstate(),
        )
        self._save("last", state)
        self.saved_step = self.step

    def _save(self, name: str, state: TrainerState | None = None) -> None:
        """Write checkpoint ``name``; a failed write (a full disk) leaves the previous one
        intact and raises an ``OSError`` that says so in one sentence."""
        if not self.is_main or self.out_dir is None:
            return
        target = self.out_dir / name
        with self._stops.saving():
            try:
                save_checkpoint(target, self.model, trainer_state=state, **self.save_info)
            except (OSError, SafetensorError) as error:
                previous = checkpoint_folder(target)
                if previous is None:
                    kept = f"no earlier checkpoint {name!r} exists"
                else:
                    of_step = f" of step {self.saved_step}" if name == "last" else ""
                    kept = f"the previous checkpoint {str(previous)!r}{of_step} is intact"
                raise OSError(f"checkpoint: cannot save {name!r} at step {self.step} in "
                              f"{str(target)!r} ({error}); {kept}") from error

    def _gather(self, tensor: Tensor) -> tuple[Tensor, ...]:
        """``tensor`` of every rank, in rank order (the RNG states differ by rank)."""
        if self.world == 1:
            return (tensor,)
        local = tensor.to(self.device)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return tuple(p.cpu() for p in parts)

    def _agreed_stop(self) -> int:
        """The stop signal any rank received (0: none), the same on every rank."""
        signum = self._stops.signum or 0
        if self.world > 1:
            flag = torch.tensor([signum], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
        return signum

    def _postfix(self, lr: float, rate: float) -> dict[str, str]:
        shown = {"loss": f"{self.last_loss:.4f}" if self.last_loss is not None else "-",
                 "lr": f"{lr:.2e}", "tok_s": f"{rate:,.0f}"}
        if self.metric in self.last_eval:
            shown[self.metric] = _figure(self.last_eval[self.metric])
        return shown

    def _log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.is_main and self.out_dir is not None:
            append_record(self.out_dir / "metrics.jsonl", record)


def _figure(value: float) -> str:
    """A metric as the progress bar shows it (4 significant digits)."""
    return f"{value:.4g}"


def _check_save_info(info: dict[str, Any]) -> None:
    """Refuse, before any training, a ``save_info`` with which no checkpoint could be saved."""
    if not isinstance(info, dict):
        raise TypeError(f"save_info: expected a dict with 'model_type' and 'model_config', got "
                        f"{type(info).__name__}")
    missing = [key for key in ("model_type", "model_config") if key not in info]
    unknown = sorted(set(info) - {"model_type", "model_config", "extra"})
    if missing or unknown:
        raise ValueError(
            f"save_info: a run with out_dir saves checkpoints, which need 'model_type' and "
            f"'model_config' (and optionally 'extra'); "
            f"{'missing ' + repr(missing) if missing else 'unknown keys ' + repr(unknown)} "
            f"in {sorted(info)}")
