"""``attnlab eval perplexity --model MODEL --text FILE [--reference MODEL] [--context N]``.

The model's perplexity on a text file, and against a ``--reference`` model over the same
vocabulary (the float model that MODEL was quantized from, say): the change in perplexity,
the KL divergence ``KL(reference || model)`` per scored token (mean and 99th percentile) and
how often the two models' top tokens agree. Computed as llama.cpp's ``perplexity`` tool
does: non-overlapping chunks of ``--context`` tokens, the second half of each scored
(``attnlab.quantization.quality``). The text is tokenized by MODEL's tokenizer, without
special tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from attnlab.arg_types import positive_int
from attnlab.cli import add_command, describe
from attnlab.cli.options import add_dtype_option, add_model_option
from attnlab.models.io import from_pretrained
from attnlab.quantization.quality import measure_quality
from attnlab.threads import add_threads_option
from attnlab.tokenizer import Tokenizer

__all__ = ["add_commands"]

_MODEL_HELP = ("a checkpoint folder or GGUF file (any that `attnlab generate --model` reads)")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``eval`` (with its one sub-command ``perplexity``) on the top-level
    sub-parsers."""
    evaluate = add_command(sub, "eval")
    what = evaluate.add_subparsers(dest="evaluation", metavar="NAME", required=True)
    p = what.add_parser("perplexity", help="perplexity, and KL divergence and top-1 agreement "
                        "against a reference model", description=describe(__doc__))
    add_model_option(p, _MODEL_HELP)
    p.add_argument("--text", required=True, type=Path,
                   help="a UTF-8 text file (at least --context tokens)")
    p.add_argument("--reference", default=None,
                   help="the model to compare with, same tokenizer (" + _MODEL_HELP[2:] + ")")
    p.add_argument("--context", type=positive_int, default=512, metavar="N",
                   help="tokens a chunk (even); the second half of each chunk is scored")
    add_dtype_option(p, "weights dtype of both models (default: each checkpoint's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_threads_option(p)
    p.set_defaults(handler=_perplexity)


def _perplexity(args: argparse.Namespace) -> int:
    if args.context % 2 or args.context < 4:
        raise ValueError(f"--context: expected an even number of tokens >= 4, got "
                         f"{args.context}")
    try:
        text = args.text.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--text: {args.text} is not UTF-8 text ({error})") from None
    ids = Tokenizer.from_pretrained(args.model).encode(text, add_special_tokens=False)
    if len(ids) < args.context:
        raise ValueError(f"--text: {args.text} has {len(ids)} tokens, fewer than --context "
                         f"{args.context}; give a longer text or a smaller --context")
    model = from_pretrained(args.model, dtype=args.dtype)
    reference = None if args.reference is None else from_pretrained(args.reference,
                                                                     dtype=args.dtype)
    if reference is not None and reference.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"--reference: its vocabulary has {reference.config.vocab_size} "
                         f"tokens, --model's {model.config.vocab_size}; expected the same "
                         "tokenizer")
    r = measure_quality(model, torch.tensor(ids), context=args.context, reference=reference,
                        progress=not args.no_progress)
    print(f"{args.text}: {len(ids)} tokens, {r.chunks} chunks of {r.context}, "
          f"{r.positions} scored")
    print(f"perplexity: {r.perplexity:.4f}")
    if r.reference_perplexity is not None:
        print(f"reference perplexity: {r.reference_perplexity:.4f} (change "
              f"{r.perplexity_change:+.4f}, {r.perplexity / r.reference_perplexity:.4f}x)")
        print(f"KL(reference || model): mean {r.kl_mean:.6f}, 99th percentile {r.kl_p99:.6f}")
        print(f"top-1 agreement: {100 * r.top1:.2f}%")
    sys.stdout.flush()
    return 0
