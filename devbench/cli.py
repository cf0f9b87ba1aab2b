"""The ``python -m devbench`` command line: one sub-command per benchmark, each with
``--out`` (default ``benchmarks/``; ``runs/bench-quick`` with ``--quick``), ``--quick`` and
``--threads``, and the benchmark's own options (its module's ``add_arguments``)."""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from attnlab.bench.harness import begin_run
from attnlab.cli import describe
from attnlab.cli.bench import first_sentence
from attnlab.threads import add_threads_option, use_threads
from devbench.history import keep_history

__all__ = ["BENCHMARKS", "OUT", "QUICK_OUT", "build_parser", "main"]

# Each module has ``add_arguments(parser)`` and ``run(args) -> Path`` (the folder or file
# written).
BENCHMARKS = {
    "attention": "devbench.attention",
    "families": "attnlab.bench.families",
    "gemv": "devbench.gemv",
    "generate": "attnlab.bench.generate",
    "llamacpp": "devbench.llamacpp",
    "mha": "devbench.mha",
    "quantization": "attnlab.bench.quantization",
    "qwen2": "devbench.qwen2",
    "sampling": "devbench.sampling",
    "serve": "attnlab.bench.serve",
    "variants": "devbench.variants",
}
OUT, QUICK_OUT = Path("benchmarks"), Path("runs/bench-quick")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark that ``argv`` names; 2 and one line on stderr for a bad value."""
    args = build_parser().parse_args(argv)
    use_threads(args.threads)
    if args.out is None:
        args.out = QUICK_OUT if args.quick else OUT
    # Every memory measurement starts with gc.collect(); with the ~200k objects that the
    # imports leave frozen out of it, each takes microseconds instead of ~0.1 s.
    gc.collect()
    gc.freeze()
    begin_run()  # the load at the start, the repeats' spread from here on
    try:
        with keep_history(args.out):
            path = args.module.run(args)
    except (ValueError, TypeError, OSError) as error:
        print(f"devbench: error: {error}", file=sys.stderr)
        return 2
    finally:
        gc.unfreeze()
    print(f"results written to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser with every benchmark's sub-command."""
    parser = argparse.ArgumentParser(
        prog="python -m devbench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=describe(importlib.import_module("devbench").__doc__ or ""))
    sub = parser.add_subparsers(dest="benchmark", metavar="NAME", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = describe(module.__doc__ or "")
        p = sub.add_parser(name, help=first_sentence(doc), description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--out", type=Path, default=None,
                       help=f"folder for the results (default: {OUT}, or {QUICK_OUT} with "
                       "--quick)")
        p.add_argument("--quick", action="store_true",
                       help=f"tiny sizes for a smoke test (the size options are ignored); "
                       f"writes to {QUICK_OUT} unless --out is given")
        add_threads_option(p)
        module.add_arguments(p)
        p.set_defaults(module=module)
    return parser
