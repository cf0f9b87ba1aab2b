"""``attnlab translate`` and ``attnlab sample``: use a checkpoint written by ``attnlab train``.

Both read the checkpoint folder through the library's public API and print to stdout.
"""

from __future__ import annotations

import argparse
import sys

import torch

from attnlab.generation import generate
from attnlab.training.checkpoint import load_model
from attnlab.training.tasks.seq2seq import SEQ2SEQ_TASKS, make_seq2seq_task
from attnlab.training.tasks.vocab import CharVocab

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``translate`` and ``sample`` on the top-level sub-parsers."""
    tr = sub.add_parser("translate", help="translate with a trained seq2seq checkpoint")
    tr.add_argument("--checkpoint", required=True, help="checkpoint folder (e.g. runs/demo/best)")
    tr.add_argument("--beams", type=int, default=1, help="beam width (1 = greedy)")
    tr.add_argument("texts", nargs="+", help="inputs to translate")
    tr.set_defaults(handler=_translate)

    sa = sub.add_parser("sample", help="sample text from a trained character LM")
    sa.add_argument("--checkpoint", required=True)
    sa.add_argument("--prompt", default="\n")
    sa.add_argument("--max-new-tokens", type=int, default=200)
    sa.add_argument("--temperature", type=float, default=0.8)
    sa.add_argument("--top-k", type=int, default=None)
    sa.add_argument("--top-p", type=float, default=None)
    sa.add_argument("--seed", type=int, default=0)
    sa.set_defaults(handler=_sample)


def _translate(args: argparse.Namespace) -> int:
    model, config = load_model(args.checkpoint)
    extra = config.get("extra", {})
    if config["model_type"] != "transformer" or extra.get("task") not in SEQ2SEQ_TASKS:
        raise ValueError(f"checkpoint: {args.checkpoint!r} is not a seq2seq checkpoint")
    task = make_seq2seq_task(
        extra["task"],
        seed=extra.get("seed", 0),
        max_len=extra.get("max_len", 12),
        n_test=1,
        n_valid=1,
    )
    if task.src_vocab.chars != extra.get("src_chars", task.src_vocab.chars):
        raise ValueError(f"checkpoint: {args.checkpoint!r} was trained with another vocabulary")
    for text, out in zip(args.texts, task.translate(model, args.texts, num_beams=args.beams)):
        print(f"{text}\t{out}")
    return 0


def _sample(args: argparse.Namespace) -> int:
    model, config = load_model(args.checkpoint)
    if config["model_type"] != "decoder_lm":
        raise ValueError(f"checkpoint: {args.checkpoint!r} is not a language-model checkpoint")
    vocab = CharVocab(config["extra"]["chars"])
    prompt = torch.tensor([vocab.encode(args.prompt)], dtype=torch.long)
    room = model.config.max_len - prompt.shape[1]
    ids = generate(
        model,
        prompt,
        min(args.max_new_tokens, room),
        do_sample=True,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    sys.stdout.write(args.prompt + vocab.decode(ids[0, prompt.shape[1] :].tolist()) + "\n")
    return 0
