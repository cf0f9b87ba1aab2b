"""``attnlab translate`` and ``attnlab sample``: use a checkpoint written by ``attnlab train``.

Both read the checkpoint folder through the library's public API and print to stdout.
``translate`` prints one line per input, ``INPUT<TAB>OUTPUT`` or ``INPUT<TAB>error: WHY``,
and exits with 1 when any input failed (the others are still translated).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from attnlab._checks import check_positive
from attnlab.cli import add_command
from attnlab.cli.options import add_model_option
from attnlab.generation import generate
from attnlab.generation.sampling import check_sampling_args
from attnlab.training.checkpoint import load_model
from attnlab.training.tasks.seq2seq import SEQ2SEQ_TASKS, Seq2SeqTask, make_seq2seq_task
from attnlab.training.tasks.vocab import SPECIALS, CharVocab, describe_characters

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``translate`` and ``sample`` on the top-level sub-parsers."""
    tr = add_command(
        sub, "translate",
        "Translate each input with a seq2seq checkpoint. One line per input: "
        "INPUT<TAB>OUTPUT, or INPUT<TAB>error: WHY for an input the model cannot read or "
        "whose output is not a valid answer (exit status 1 if any failed).")
    add_model_option(tr, "checkpoint folder (e.g. runs/demo/best)", alias="--checkpoint")
    tr.add_argument("--beams", type=int, default=1, help="beam width (1 = greedy)")
    tr.add_argument("texts", nargs="+", metavar="TEXT", help="inputs to translate")
    tr.set_defaults(handler=_translate)

    sa = add_command(
        sub, "sample",
        "Continue a prompt with a character-level LM checkpoint; the prompt and "
        "the new text go to stdout, and a note to stderr when it stops early (the model's "
        "context is full, or the model produced a special token).")
    add_model_option(sa, "checkpoint folder (e.g. runs/lm/best)", alias="--checkpoint")
    sa.add_argument("--prompt", default=None,
                    help="text to continue, in the model's characters (None: a newline, or the "
                    "model's first character if its text had no newline)")
    sa.add_argument("--max-new-tokens", type=int, default=200,
                    help="characters to generate (fewer if the model's context runs out)")
    sa.add_argument("--temperature", type=float, default=0.8,
                    help="divides the logits before sampling (> 0; lower is more conservative)")
    sa.add_argument("--top-k", type=int, default=None,
                    help="sample among the k most likely characters only (None: all)")
    sa.add_argument("--top-p", type=float, default=None,
                    help="sample among the most likely characters whose probability sums to "
                    "p, in (0, 1] (None: all)")
    sa.add_argument("--seed", type=int, default=0, help="random seed of the sampling")
    sa.set_defaults(handler=_sample)


def _translate(args: argparse.Namespace) -> int:
    check_positive("--beams", args.beams)
    model, task = _load_seq2seq(args.model)
    results = task.translate_checked(model, args.texts, num_beams=args.beams)
    failed = 0
    for number, result in enumerate(results, start=1):
        if result.error is None:
            print(f"{_printable(result.source)}\t{result.output}")
        else:
            failed += 1
            print(f"{_printable(result.source)}\terror: input {number}: {result.error}")
    if failed:
        print(f"attnlab translate: {failed} of {len(results)} inputs failed", file=sys.stderr)
    return 1 if failed else 0


def _sample(args: argparse.Namespace) -> int:
    check_positive("--max-new-tokens", args.max_new_tokens)
    _check_sampling_flags(args)
    if not -(2**63) <= args.seed < 2**64:  # the range torch.Generator.manual_seed takes
        raise ValueError(f"--seed: expected an int from -2**63 to 2**64 - 1, got {args.seed}")
    model, vocab = _load_lm(args.model)
    max_len = model.config.max_len
    if args.prompt is None:
        args.prompt = "\n" if "\n" in vocab.chars else vocab.chars[0]
    _check_prompt(args.prompt, vocab, max_len)
    prompt = torch.tensor([vocab.encode(args.prompt)], dtype=torch.long)
    room = max_len - prompt.shape[1]
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
    text, special = vocab.read(ids[0, prompt.shape[1] :].tolist())
    sys.stdout.write(args.prompt + text + "\n")
    # The model trains on text only, so a special token is no character to print: stop there.
    if special is not None:
        why = f"the model produced {SPECIALS[special]}, which is no character"
    elif room < args.max_new_tokens:
        why = (f"the prompt ({prompt.shape[1]}) and the new characters fill the model's "
               f"context of {max_len} (max_len)")
    else:
        return 0
    print(f"attnlab sample: stopped after {len(text)} of {args.max_new_tokens} new characters: "
          f"{why}", file=sys.stderr)
    return 0


def _load_seq2seq(checkpoint: str) -> tuple[torch.nn.Module, Seq2SeqTask]:
    """The model of a ``train seq2seq`` checkpoint and its task, rebuilt and checked to fit."""
    model, config = load_model(checkpoint)
    extra = config.get("extra", {})
    if config["model_type"] != "transformer" or extra.get("task") not in SEQ2SEQ_TASKS:
        raise ValueError(f"checkpoint: {checkpoint!r} is not a seq2seq checkpoint")
    max_len = extra.get("max_len", 12)
    check_positive(f"checkpoint: extra.max_len in {checkpoint!r}", max_len)
    task = make_seq2seq_task(
        extra["task"], seed=extra.get("seed", 0), max_len=max_len, n_test=1, n_valid=1
    )
    same = (task.src_vocab.chars == extra.get("src_chars", task.src_vocab.chars)
            and task.tgt_vocab.chars == extra.get("tgt_chars", task.tgt_vocab.chars)
            and (len(task.src_vocab), len(task.tgt_vocab))
            == (model.config.src_vocab_size, model.config.tgt_vocab_size))
    if not same:
        raise ValueError(f"checkpoint: {checkpoint!r} was trained with another vocabulary")
    return model, task


def _load_lm(checkpoint: str) -> tuple[torch.nn.Module, CharVocab]:
    """The model of a ``train lm`` checkpoint and its character vocabulary, checked to fit."""
    model, config = load_model(checkpoint)
    if config["model_type"] != "decoder_lm":
        raise ValueError(f"checkpoint: {checkpoint!r} is not a language-model checkpoint")
    chars = config.get("extra", {}).get("chars")
    if (not isinstance(chars, str) or not chars
            or len(CharVocab(chars)) != model.config.vocab_size):
        raise ValueError(
            f"checkpoint: {checkpoint!r} has no vocabulary of its model's "
            f"{model.config.vocab_size} tokens (extra.chars in config.json, got {chars!r:.80})"
        )
    return model, CharVocab(chars)


def _check_prompt(prompt: str, vocab: CharVocab, max_len: int) -> None:
    """A ``ValueError`` naming ``--prompt`` unless the model can read it and continue it."""
    if not prompt:
        raise ValueError("--prompt: expected at least one character, got ''")
    if len(prompt) >= max_len:
        raise ValueError(
            f"--prompt: {len(prompt)} characters, the model's context is {max_len} (max_len); "
            f"expected at most {max_len - 1} to leave room for a new one"
        )
    unknown = vocab.unknown(prompt)
    if unknown:
        raise ValueError(
            f"--prompt: characters not in the model's vocabulary: {describe_characters(unknown)}"
        )


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """The sampling flags' checks (``check_sampling_args``), with the flags' names."""
    if not args.temperature > 0 or not math.isfinite(args.temperature):
        raise ValueError(
            f"--temperature: expected a finite number > 0 (sample always samples; a small "
            f"value such as 0.1 is close to greedy), got {args.temperature}"
        )
    try:
        check_sampling_args(args.temperature, args.top_k, args.top_p)
    except ValueError as error:
        name, _, why = str(error).partition(": ")
        raise ValueError(f"--{name.replace('_', '-')}: {why}") from None


def _printable(text: str) -> str:
    """``text`` on one line: control characters (a tab, a newline) escaped as in Python."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
