"""The options that several commands share, spelled the same everywhere: ``--model DIR`` for a
checkpoint folder (an older spelling kept as an alias), ``--dtype`` with one set of choices,
and the positional ``FOLDER OUT`` of ``quantize`` kept beside ``--model``/``--out``."""

from __future__ import annotations

import argparse

from attnlab.models.hf_loading import SUPPORTED_DTYPES

__all__ = ["DTYPES", "add_dtype_option", "add_model_option", "model_and_out"]

DTYPES = tuple(sorted(SUPPORTED_DTYPES))


def add_model_option(parser: argparse.ArgumentParser, help: str, *, alias: str | None = None,
                     required: bool = True) -> None:
    """``--model DIR`` (``args.model``); ``alias`` (e.g. ``--checkpoint``) is accepted too."""
    names = ("--model", alias) if alias else ("--model",)
    parser.add_argument(*names, dest="model", required=required, default=None, metavar="DIR",
                        help=help)


def add_dtype_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--dtype`` among ``DTYPES``, None when not given (``help`` says what None means)."""
    parser.add_argument("--dtype", choices=DTYPES, default=None, help=help)


def model_and_out(args: argparse.Namespace, *, with_out: bool) -> None:
    """Resolve the positional ``FOLDER [OUT]`` (``args.paths``, the old spelling) into
    ``args.model`` (and ``args.out``): one spelling or the other, each path once."""
    names = ("FOLDER", "OUT") if with_out else ("FOLDER",)
    if args.paths:
        if len(args.paths) != len(names):
            raise ValueError(f"{' '.join(names)}: expected {len(names)} positional path(s), got "
                             f"{len(args.paths)} ({' '.join(args.paths)})")
        if args.model is not None or (with_out and args.out is not None):
            raise ValueError(f"--model{' / --out' if with_out else ''}: give the paths once, "
                             f"as options or as {' '.join(names)}, not both")
        args.model = args.paths[0]
        if with_out:
            args.out = args.paths[1]
    missing = ["--model"] if args.model is None else []
    if with_out and args.out is None:
        missing.append("--out")
    if missing:
        raise ValueError(f"{' and '.join(missing)}: required (or the positional "
                         f"{' '.join(names)})")
