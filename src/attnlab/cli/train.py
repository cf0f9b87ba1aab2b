"""``attnlab train seq2seq|lm``: train an encoder-decoder on a generated task, or a
character-level decoder-only LM on a UTF-8 text file.

Training runs unchanged under ``torchrun`` (one process per device; only rank 0 writes).
Every command ends by naming the folder it wrote. SIGINT (Ctrl-C) and SIGTERM stop a run at
the end of its step with a checkpoint (exit status 130 and 143); ``--resume`` continues it
exactly, and refuses options that contradict the saved run. One run at a time uses a run
folder (``training.run_lock``: a second is refused naming the first's process). A NaN or
infinite loss stops the run naming the step (``--skip-nonfinite`` skips such steps), and a
checkpoint that cannot be written (a full disk) ends it in one line naming the previous
checkpoint, which is intact.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from attnlab.arg_types import (
    fraction,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from attnlab.cli import add_command
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.threads import add_threads_option
from attnlab.training.checkpoint import checkpoint_folder, load_config, load_trainer_state
from attnlab.training.distributed import cleanup_distributed, init_distributed
from attnlab.training.run_lock import RunLock
from attnlab.training.tasks.seq2seq import SEQ2SEQ_TASKS, make_seq2seq_task
from attnlab.training.tasks.text import CharLMTask, read_text
from attnlab.training.trainer import TrainConfig, Trainer, TrainingInterrupted

__all__ = ["RESUME_MAY_CHANGE", "add_commands", "time_estimate"]

# Options that a resumed run may set anew; none changes the arithmetic of the steps done.
RESUME_MAY_CHANGE = ("--steps", "--eval-every", "--log-every", "--patience", "--no-progress",
                     "--skip-nonfinite")
# Options that are not part of a run's recipe.
_NOT_RECIPE = ("command", "kind", "handler", "out", "resume", "text", "threads")

def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``train`` on the top-level sub-parsers."""
    train = add_command(sub, "train", __doc__)
    kinds = train.add_subparsers(dest="kind", metavar="KIND", required=True)

    s2s = kinds.add_parser("seq2seq", help="encoder-decoder on a generated task",
                           description="Train an encoder-decoder Transformer on a generated "
                           "task (dates to ISO 8601, or copy/reverse/sort/add of digits).")
    s2s.add_argument("--task", choices=SEQ2SEQ_TASKS, default="dates",
                     help="generated task: human dates to ISO 8601, or copy/reverse/sort/add "
                     "of digit strings")
    s2s.add_argument("--max-len", type=positive_int, default=12,
                     help="longest input of copy/reverse/sort/add")
    _model_arguments(s2s, d_model=128, layers=2, heads=8)
    _train_arguments(s2s)
    s2s.set_defaults(handler=_train_seq2seq)

    lm = kinds.add_parser("lm", help="character-level decoder-only LM on a UTF-8 text file",
                          description="Train a character-level decoder-only LM (GPT or Llama "
                          "style) on a UTF-8 text file.")
    lm.add_argument("--text", required=True, help="UTF-8 text file to learn")
    lm.add_argument("--block-size", type=positive_int, default=128,
                    help="characters of context per training window")
    lm.add_argument("--style", choices=("gpt", "llama"), default="gpt",
                    help="gpt: learned positions, LayerNorm, GELU; llama: RoPE, RMSNorm, SwiGLU, "
                    "grouped-query attention")
    _model_arguments(lm, d_model=128, layers=4, heads=4)
    _train_arguments(lm)
    lm.set_defaults(handler=_train_lm)


def _model_arguments(p: argparse.ArgumentParser, *, d_model: int, layers: int, heads: int) -> None:
    p.add_argument("--d-model", type=positive_int, default=d_model,
                   help="model width E (a multiple of --heads)")
    p.add_argument("--layers", type=positive_int, default=layers,
                   help="layers (per stack for seq2seq)")
    p.add_argument("--heads", type=positive_int, default=heads, help="attention heads")
    p.add_argument("--d-ff", type=positive_int, default=None,
                   help="feed-forward width; None: 4 x d-model (llama: 8/3 x d-model, rounded)")
    p.add_argument("--dropout", type=fraction, default=0.1, help="dropout probability")


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="run folder: checkpoints, metrics.jsonl")
    p.add_argument("--steps", type=positive_int, default=2000,
                   help="optimizer steps of the whole run")
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="global batch size (sequences per step, all processes together)")
    p.add_argument("--lr", type=positive_float, default=1e-3,
                   help="peak learning rate (noam: a factor on its d-model^-0.5 curve)")
    p.add_argument("--schedule", choices=("cosine", "noam", "constant"), default="cosine",
                   help="learning-rate schedule after the linear warmup")
    p.add_argument("--warmup", type=non_negative_int, default=100,
                   help="warmup steps of the schedule")
    p.add_argument("--grad-accum", type=positive_int, default=1,
                   help="micro-batches per step (the batch size must be a multiple)")
    p.add_argument("--grad-clip", type=non_negative_float, default=1.0,
                   help="clip the gradient norm to this value (0: no clipping)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--eval-every", type=positive_int, default=200,
                   help="steps between evaluations and checkpoints")
    p.add_argument("--log-every", type=positive_int, default=10,
                   help="steps between the loss records of metrics.jsonl")
    p.add_argument("--patience", type=positive_int, default=None,
                   help="early stopping: evaluations without improvement before stopping")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the weights")
    p.add_argument("--resume", action="store_true", help=(
        "continue the run saved in OUT/last exactly where it stopped; every other option "
        "must equal the saved run's, except " + ", ".join(RESUME_MAY_CHANGE)
        + " (a larger --steps extends the run: the schedule stretches from the resumed step)"))
    p.add_argument("--skip-nonfinite", action="store_true", help=(
        "skip a step whose loss or gradient norm is NaN or infinite (no update; recorded in "
        "metrics.jsonl as skipped) instead of stopping the run there"))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_threads_option(p)


def _train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        schedule=args.schedule,
        warmup=args.warmup,
        grad_accum=args.grad_accum,
        grad_clip=args.grad_clip or None,
        bf16=args.bf16,
        eval_every=args.eval_every,
        checkpoint_every=args.eval_every,
        log_every=args.log_every,
        patience=args.patience,
        seed=args.seed,
        skip_nonfinite=args.skip_nonfinite,
    )


def _run(
    model: torch.nn.Module,
    task: object,
    args: argparse.Namespace,
    save_info: dict,
    metric: str,
    higher_is_better: bool,
) -> int:
    device = init_distributed()
    try:
        out = Path(args.out)
        _saved_run(out, args.resume)  # refused before the lock, which makes the folder
        with _lock(out):
            return _train(model, task, args, save_info, metric, higher_is_better, device)
    finally:
        cleanup_distributed()


def _lock(out: Path) -> AbstractContextManager:
    """The run folder's lock, held by rank 0 (the only writer) while the run lasts."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return nullcontext()
    return RunLock(out)


def _saved_run(out: Path, resume: bool) -> Path | None:
    """The checkpoint ``last`` to resume; refuses a missing one, and a new run on an old."""
    saved = checkpoint_folder(out / "last")
    if resume and saved is None:
        raise ValueError(f"--resume: {str(out)!r} holds no run to resume (no checkpoint "
                         "'last'); leave out --resume to start a new run")
    if not resume and saved is not None:
        raise ValueError(f"--out: {str(out)!r} already holds a run; pass --resume to "
                         "continue it or choose another folder")
    return saved


def _train(model: torch.nn.Module, task: object, args: argparse.Namespace, save_info: dict,
           metric: str, higher_is_better: bool, device: torch.device) -> int:
    """The run itself, under the lock of its folder ``args.out``."""
    out = Path(args.out)
    saved = _saved_run(out, args.resume)  # again: another run may have saved meanwhile
    if saved is not None:
        _check_same_run(saved, save_info["extra"])
    with Trainer(
        model,
        task,
        _train_config(args),
        out_dir=out,
        save_info=save_info,
        metric=metric,
        higher_is_better=higher_is_better,
        d_model=args.d_model,
        progress=not args.no_progress,
        device=device,
    ) as trainer:
        if args.resume:
            trainer.resume()
            if trainer.is_main:
                print(f"resumed from {saved} at step {trainer.step}")
        if trainer.step >= args.steps:
            if trainer.is_main:
                print(f"the run in {out} is already at step {trainer.step} of --steps "
                      f"{args.steps}: nothing to do (a larger --steps trains further)")
            return 0
        if trainer.is_main:
            print(time_estimate(trainer.estimate_step_seconds(), args.steps - trainer.step))
        try:
            result = trainer.fit()
        except TrainingInterrupted as stop:
            if trainer.is_main:
                print(f"stopped after step {stop.step}: checkpoint saved in {stop.saved}; "
                      "continue with --resume", file=sys.stderr)
            return stop.exit_code
        except KeyboardInterrupt:
            if trainer.is_main:
                print("stopped at once: nothing saved since the last checkpoint in "
                      f"{out / 'last'}; continue with --resume", file=sys.stderr)
            return 130
        if trainer.is_main:
            how = "stopped early at" if result.stopped_early else "reached"
            best = "-" if result.best_metric is None else f"{result.best_metric:.4f}"
            print(f"{how} step {result.step}: loss {result.final_loss:.4f}, best {metric} "
                  f"{best}; outputs in {out}")
        return 0


def _check_same_run(saved: Path, extra: dict[str, Any]) -> None:
    """Refuse to resume the run in ``saved`` with options that contradict it."""
    load_trainer_state(saved)  # a run of an older attnlab is refused with the reason
    old = load_config(saved).get("extra", {})
    if not isinstance(old.get("flags"), dict):
        raise ValueError(f"--resume: the checkpoint in {str(saved)!r} holds no record of the "
                         "options it was started with (it was saved by the Python API); "
                         "resume it with Trainer.resume")
    given, before = extra["flags"], old["flags"]
    differ = [f"{flag} (saved {before.get(flag)!r}, given {given.get(flag)!r})"
              for flag in sorted(set(given) | set(before))
              if flag not in RESUME_MAY_CHANGE and before.get(flag) != given.get(flag)]
    if old.get("text_sha256") != extra.get("text_sha256"):
        differ.append(f"--text (saved {old.get('text')!r} with sha256 "
                      f"{str(old.get('text_sha256'))[:12]}..., given {extra.get('text')!r} "
                      f"with sha256 {str(extra.get('text_sha256'))[:12]}...)")
    if differ:
        raise ValueError(f"--resume: the run in {str(saved)!r} was started with other "
                         f"options: {'; '.join(differ)}; pass the saved values (only "
                         f"{', '.join(RESUME_MAY_CHANGE)} may change on resume)")


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    """The options that define the run, as the user spells them (``--d-model``)."""
    return {"--" + name.replace("_", "-"): value for name, value in sorted(vars(args).items())
            if name not in _NOT_RECIPE}


def time_estimate(seconds: float, steps: int) -> str:
    """What a run of ``steps`` steps of ``seconds`` each will take, said before it starts."""
    total = seconds * steps
    if total < 90:
        span = f"{total:.0f} s"
    elif total < 5400:
        span = f"{total / 60:.0f} min"
    else:
        span = f"{total / 3600:.1f} h"
    return f"about {seconds:.3g} s/step, ~{span} for {steps} steps (evaluations extra)"


def _train_seq2seq(args: argparse.Namespace) -> int:
    _check_multiples(args)
    task = make_seq2seq_task(args.task, seed=args.seed, max_len=args.max_len)
    torch.manual_seed(args.seed)
    config = TransformerConfig(
        len(task.src_vocab),
        len(task.tgt_vocab),
        d_model=args.d_model,
        num_heads=args.heads,
        num_encoder_layers=args.layers,
        num_decoder_layers=args.layers,
        d_ff=args.d_ff or 4 * args.d_model,
        dropout=args.dropout,
        norm_first=True,
        max_len=128,
    )
    info = {
        "model_type": "transformer",
        "model_config": config.to_dict(),
        "extra": {
            "task": args.task,
            "seed": args.seed,
            "max_len": args.max_len,
            "src_chars": task.src_vocab.chars,
            "tgt_chars": task.tgt_vocab.chars,
            "flags": _flags(args),
        },
    }
    return _run(Transformer(config), task, args, info, "valid_exact_match", True)


def _train_lm(args: argparse.Namespace) -> int:
    _check_multiples(args)
    text = read_text(args.text)
    task = CharLMTask(text, block_size=args.block_size, seed=args.seed)
    torch.manual_seed(args.seed)
    make = DecoderLMConfig.llama if args.style == "llama" else DecoderLMConfig.gpt
    config = make(
        len(task.vocab),
        d_model=args.d_model,
        num_layers=args.layers,
        num_heads=args.heads,
        d_ff=args.d_ff,
        dropout=args.dropout,
        max_len=max(args.block_size, 256),
    )
    info = {
        "model_type": "decoder_lm",
        "model_config": config.to_dict(),
        "extra": {
            "task": "lm",
            "chars": task.vocab.chars,
            "flags": _flags(args),
            "text": args.text,
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        },
    }
    return _run(DecoderLM(config), task, args, info, "valid_loss", False)


def _check_multiples(args: argparse.Namespace) -> None:
    if args.d_model % args.heads:
        raise ValueError(f"--d-model: expected a multiple of --heads={args.heads}, "
                         f"got {args.d_model}")
    if args.batch_size % args.grad_accum:
        raise ValueError(f"--batch-size: expected a multiple of --grad-accum="
                         f"{args.grad_accum}, got {args.batch_size}")
