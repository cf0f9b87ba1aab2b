"""A plain, readable training loop: AdamW, warmup schedules, clipping, accumulation, bf16
autocast, periodic evaluation with early stopping, checkpoints with exact resume, JSON-lines
metrics, and DistributedDataParallel when launched by ``torchrun``.

The data of step ``s`` is a pure function of ``(seed, s)`` (``Task.batch``), so resuming
needs no data-loader state: model, optimizer, scheduler, step and RNG states are enough.
Under ``torchrun`` every rank computes its own shard of the same global batch, and the loss
is normalised by the global token count, so N processes reach the same parameters as one.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from attnlab._checks import check_positive
from attnlab.models.config import ConfigMixin
from attnlab.training.checkpoint import load_trainer_state, load_weights, save_checkpoint
from attnlab.training.schedules import make_schedule

__all__ = ["Task", "TrainConfig", "TrainResult", "Trainer"]


@dataclass(frozen=True)
class TrainConfig(ConfigMixin):
    """Options of a training run (serialisable to JSON)."""

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
    ``on_step(step, loss)`` is called after each optimizer step (tests use it to interrupt).
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
        self.history: list[dict[str, Any]] = []

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def resume(self) -> bool:
        """Restore the last checkpoint in ``out_dir/last`` if there is one; True if restored."""
        if self.out_dir is None or not (self.out_dir / "last").is_dir():
            return False
        state = load_trainer_state(self.out_dir / "last")
        if state is None:
            return False
        load_weights(self.out_dir / "last", self.model)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.best, self.bad_evals = state["step"], state["best"], state["bad_evals"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        return True

    def fit(self) -> TrainResult:
        """Run until ``config.steps`` (or early stopping). Ctrl-C saves ``last`` and re-raises."""
        c = self.config
        if self.step == 0:
            torch.manual_seed(c.seed + self.rank)  # dropout; a resumed run restores its RNG
        bar = tqdm(
            total=c.steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=not (self.progress and self.is_main),
            dynamic_ncols=True,
        )
        loss_value = math.nan
        stopped = False
        tokens, t0 = 0, time.perf_counter()
        try:
            while self.step < c.steps and not stopped:
                loss_value, n_tokens = self._train_step()
                self.step += 1
                tokens += n_tokens
                if self.on_step is not None:
                    self.on_step(self.step, loss_value)
                if self.step % c.log_every == 0 or self.step == c.steps:
                    rate = tokens / max(time.perf_counter() - t0, 1e-9)
                    lr = self.scheduler.get_last_lr()[0]
                    self._log(
                        {"step": self.step, "loss": loss_value, "lr": lr, "tokens_per_s": rate}
                    )
                    bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", tok_s=f"{rate:,.0f}")
                    tokens, t0 = 0, time.perf_counter()
                bar.update(1)
                if self.step % c.eval_every == 0 or self.step == c.steps:
                    stopped = self._evaluate()
                if self.step % c.checkpoint_every == 0 or self.step == c.steps or stopped:
                    self._save("last")
        except KeyboardInterrupt:
            self._save("last")
            raise
        finally:
            bar.close()
        return TrainResult(self.step, loss_value, self.best, self.history, stopped)

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
        if c.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        mean = torch.tensor([running, float(local_tokens)], device=self.device)
        if self.world > 1:
            dist.all_reduce(mean)
        return (mean[0] / mean[1].clamp_min(1)).item(), int(mean[1].item())

    def _evaluate(self) -> bool:
        """Evaluate on rank 0; returns whether to stop early (agreed by every rank)."""
        stop = [False]
        if self.is_main:
            self.model.eval()
            with torch.no_grad():
                metrics = self.task.evaluate(self.model)
            self._log({"step": self.step, **metrics})
            value = metrics.get(self.metric)
            if value is not None:
                better = self.best is None or (
                    value > self.best if self.higher_is_better else value < self.best
                )
                if better:
                    self.best, self.bad_evals = value, 0
                    self._save("best")
                else:
                    self.bad_evals += 1
                stop[0] = (
                    self.config.patience is not None and self.bad_evals >= self.config.patience
                )
        if self.world > 1:
            dist.broadcast_object_list(stop, src=0)
        return stop[0]

    def _save(self, name: str) -> None:
        if not self.is_main or self.out_dir is None:
            return
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "best": self.best,
            "bad_evals": self.bad_evals,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "train_config": self.config.to_dict(),
        }
        save_checkpoint(self.out_dir / name, self.model, trainer_state=state, **self.save_info)

    def _log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.is_main and self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
