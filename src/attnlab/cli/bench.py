"""``attnlab bench NAME``: measure a model on this machine, as ``vllm bench`` does: ``generate``
(KV-cached generation, ``--model DIR`` for your checkpoint), ``serve`` (``attnlab serve`` under
concurrent clients), ``families`` (ours vs transformers, ``--model DIR`` for yours) and
``quantization`` (the accuracy of quantized weights).

Each writes its table, data and plot into ``--out`` (``runs/bench``; ``runs/bench-quick`` with
``--quick``). The developer benchmarks (``attention``, ``mha``, ``gemv``, ``sampling``,
``variants``, ``qwen2``) and the committed tables with their history live in the repository's
``devbench/`` (``python -m devbench NAME``); ``attnlab bench`` with one of their names says so.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import re
import sys
from pathlib import Path

from attnlab.bench.harness import begin_run
from attnlab.cli import add_command, describe
from attnlab.threads import add_threads_option

__all__ = ["BENCHMARKS", "MOVED", "add_commands", "first_sentence"]

# Each benchmark module has ``add_arguments(parser)`` and ``run(args) -> Path`` (the folder
# or file written).
BENCHMARKS = {
    "families": "attnlab.bench.families",
    "generate": "attnlab.bench.generate",
    "quantization": "attnlab.bench.quantization",
    "serve": "attnlab.bench.serve",
}
# The developer benchmarks that moved out of the installed package.
MOVED = ("attention", "gemv", "mha", "qwen2", "sampling", "variants")
BENCH_OUT, BENCH_QUICK_OUT = Path("runs/bench"), Path("runs/bench-quick")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``bench`` and its benchmarks on the top-level sub-parsers."""
    bench = add_command(sub, "bench", __doc__)
    bench_sub = bench.add_subparsers(dest="benchmark", metavar="NAME", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = describe(module.__doc__ or "")
        p = bench_sub.add_parser(name, help=first_sentence(doc), description=doc)
        p.add_argument(
            "--out",
            type=Path,
            default=None,
            help=f"folder for the results (None: {BENCH_OUT}, or {BENCH_QUICK_OUT} with --quick)",
        )
        p.add_argument(
            "--quick",
            action="store_true",
            help=f"tiny sizes for a smoke test (the size options are ignored); writes to "
            f"{BENCH_QUICK_OUT} unless --out is given",
        )
        add_threads_option(p)
        module.add_arguments(p)
        p.set_defaults(handler=_bench_handler(module))
    for name in MOVED:
        where = f"moved to the repository's devbench/: python -m devbench {name}"
        # No options of its own ("+" is no option prefix here): whatever follows is swallowed,
        # so that an old command line gets the one line that says where it went.
        p = bench_sub.add_parser(name, help=where, description=f"{where}.", add_help=False,
                                 prefix_chars="+")
        p.add_argument("rest", nargs="*", help="the rest of the old command line (ignored)")
        p.set_defaults(handler=_moved(name), moved=True)


def first_sentence(text: str) -> str:
    """The first sentence of ``text``'s first paragraph, whole (a help line never stops
    mid-sentence)."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    return re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0].rstrip(".")


def _moved(name: str):
    def handler(args: argparse.Namespace) -> int:
        print(f"attnlab bench {name}: moved to the repository's devbench/; run "
              f"`python -m devbench {name}` from a clone of attnlab", file=sys.stderr)
        return 2

    return handler


def _bench_handler(module):
    def handler(args: argparse.Namespace) -> int:
        if args.out is None:
            args.out = BENCH_QUICK_OUT if args.quick else BENCH_OUT
        # Every memory measurement starts with gc.collect(); with the ~200k objects that the
        # imports leave frozen out of it, each takes microseconds instead of ~0.1 s.
        gc.collect()
        gc.freeze()
        begin_run()  # the load at the start, the repeats' spread from here on
        try:
            path = module.run(args)
        finally:
            gc.unfreeze()
        print(f"results written to {path}")
        return 0

    return handler
