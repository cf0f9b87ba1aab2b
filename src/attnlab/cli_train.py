"""``attnlab train seq2seq|lm``.

Training runs unchanged under ``torchrun`` (one process per device; only rank 0 writes).
Every command ends by naming the folder it wrote.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.training.distributed import cleanup_distributed, init_distributed
from attnlab.training.tasks.seq2seq import SEQ2SEQ_TASKS, make_seq2seq_task
from attnlab.training.tasks.text import CharLMTask, read_text
from attnlab.training.trainer import TrainConfig, Trainer

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``train`` on the top-level sub-parsers."""
    train = sub.add_parser("train", help="train a model (runs under torchrun too)")
    kinds = train.add_subparsers(dest="kind", metavar="KIND", required=True)

    s2s = kinds.add_parser("seq2seq", help="encoder-decoder on a generated task")
    s2s.add_argument("--task", choices=SEQ2SEQ_TASKS, default="dates")
    s2s.add_argument(
        "--max-len", type=int, default=12, help="input length of copy/reverse/sort/add"
    )
    _model_arguments(s2s, d_model=128, layers=2, heads=8)
    _train_arguments(s2s)
    s2s.set_defaults(handler=_train_seq2seq)

    lm = kinds.add_parser("lm", help="character-level decoder-only LM on a UTF-8 text file")
    lm.add_argument("--text", required=True, help="UTF-8 text file to learn")
    lm.add_argument("--block-size", type=int, default=128)
    lm.add_argument("--style", choices=("gpt", "llama"), default="gpt")
    _model_arguments(lm, d_model=128, layers=4, heads=4)
    _train_arguments(lm)
    lm.set_defaults(handler=_train_lm)


def _model_arguments(p: argparse.ArgumentParser, *, d_model: int, layers: int, heads: int) -> None:
    p.add_argument("--d-model", type=int, default=d_model)
    p.add_argument("--layers", type=int, default=layers, help="layers (per stack for seq2seq)")
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--d-ff", type=int, default=None, help="default 4 x d-model")
    p.add_argument("--dropout", type=float, default=0.1)


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="run folder: checkpoints, metrics.jsonl")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--schedule", choices=("cosine", "noam", "constant"), default="cosine")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--patience", type=int, default=None, help="early stopping (evaluations)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from OUT/last")
    p.add_argument("--no-progress", action="store_true")


def _train_config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        schedule=args.schedule,
        warmup=args.warmup,
        grad_accum=args.grad_accum,
        grad_clip=args.grad_clip,
        bf16=args.bf16,
        eval_every=args.eval_every,
        checkpoint_every=args.eval_every,
        patience=args.patience,
        seed=args.seed,
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
        if not args.resume and (out / "last").exists():
            raise ValueError(
                f"out: {str(out)!r} already holds a run; pass --resume to continue it "
                "or choose another folder"
            )
        trainer = Trainer(
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
        )
        if args.resume and trainer.resume():
            print(f"resumed from {out / 'last'} at step {trainer.step}")
        try:
            result = trainer.fit()
        except KeyboardInterrupt:
            if trainer.is_main:
                print(f"\ninterrupted: checkpoint saved in {out / 'last'}; continue with --resume")
            return 130
        if trainer.is_main:
            print(
                f"step {result.step}: loss {result.final_loss:.4f}, best {metric} "
                f"{result.best_metric}; outputs in {out}"
            )
        return 0
    finally:
        cleanup_distributed()


def _train_seq2seq(args: argparse.Namespace) -> int:
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
        },
    }
    return _run(Transformer(config), task, args, info, "valid_exact_match", True)


def _train_lm(args: argparse.Namespace) -> int:
    task = CharLMTask(read_text(args.text), block_size=args.block_size, seed=args.seed)
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
        "extra": {"task": "lm", "chars": task.vocab.chars},
    }
    return _run(DecoderLM(config), task, args, info, "valid_loss", False)
