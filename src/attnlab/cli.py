"""The ``attnlab`` command line: ``attnlab demo``, ``attnlab build``, ``attnlab bench NAME``, and
the commands of ``cli_train``, ``cli_infer``, ``cli_viz``, ``cli_generate``, ``cli_quantize``,
``cli_serve``, ``cli_calibrate``, ``cli_eval`` and ``cli_exercises``.

Each command uses the library's public API only and names the folder it wrote when it ends.
``attnlab bench NAME --quick`` writes to ``runs/bench-quick`` unless ``--out`` says otherwise,
so that a smoke run never overwrites the tables committed in ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

from attnlab import __version__
from attnlab.bench.harness import begin_run
from attnlab.cli_calibrate import add_commands as add_calibrate_commands
from attnlab.cli_eval import add_commands as add_eval_commands
from attnlab.cli_exercises import add_commands as add_exercises_commands
from attnlab.cli_generate import add_commands as add_generate_commands
from attnlab.cli_infer import add_commands as add_infer_commands
from attnlab.cli_quantize import add_commands as add_quantize_commands
from attnlab.cli_serve import add_commands as add_serve_commands
from attnlab.cli_train import add_commands
from attnlab.cli_viz import add_commands as add_viz_commands
from attnlab.kernels import native
from attnlab.threads import add_threads_option, use_threads

# Each benchmark module has ``add_arguments(parser)`` and ``run(args) -> Path`` (the folder
# or file written).
BENCHMARKS = {
    "attention": "attnlab.bench.attention",
    "families": "attnlab.bench.families",
    "gemv": "attnlab.bench.gemv",
    "generate": "attnlab.bench.generate",
    "mha": "attnlab.bench.mha",
    "qwen2": "attnlab.bench.qwen2",
    "quantization": "attnlab.bench.quantization",
    "sampling": "attnlab.bench.sampling",
    "serve": "attnlab.bench.serve",
    "variants": "attnlab.bench.variants",
}
BENCH_OUT, BENCH_QUICK_OUT = Path("benchmarks"), Path("runs/bench-quick")
# The commands that say so when the machine is busy and no one chose the thread count. The
# others take --threads too: a benchmark records the load in its table instead, and a server
# outlives the load of the moment it starts.
NOTE_WHEN_BUSY = ("demo", "train", "generate")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnlab`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    try:
        if hasattr(args, "threads"):  # a command with add_threads_option's --threads
            use_threads(args.threads, note_when_busy=args.command in NOTE_WHEN_BUSY)
        return int(args.handler(args) or 0)
    except (ValueError, TypeError, OSError) as error:
        print(f"attnlab: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as error:
        print("attnlab: interrupted", file=sys.stderr)
        return getattr(error, "exit_code", 130)


def build_parser() -> argparse.ArgumentParser:
    """The ``attnlab`` parser with every sub-command (each shows its options' defaults)."""
    parser = _Parser(prog="attnlab", description="A Transformer toolkit for PyTorch.")
    parser.add_argument(
        "--version", action="version", version=f"attnlab {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="train a Transformer to translate dates into ISO 8601")
    demo.add_argument("--out", default="runs/demo", help="output folder")
    demo.add_argument(
        "--retrain", action="store_true", help="train again even if a checkpoint exists"
    )
    demo.add_argument("--steps", type=int, default=1200, help="training steps")
    demo.add_argument("--batch-size", type=int, default=128, help="examples per training step")
    demo.add_argument("--intro", action="store_true", help="only a short tour of the attention API")
    add_threads_option(demo)
    demo.set_defaults(handler=_run_demo)

    build = sub.add_parser(
        "build", help="compile attnlab's C++ kernels for this CPU (once; 1-3 min)",
        description="Compile the native kernels (attnlab.kernels.native) for this CPU and "
        "torch into $ATTNLAB_CACHE_DIR/native (else ~/.cache/attnlab/native), where every "
        "later process loads them; nothing else ever compiles. Says 'already built' at once "
        "when they are. Without them everything runs the reference modules. Exit status 2 "
        "when a C++ compiler or ninja is missing, 1 when the compile fails.")
    build.set_defaults(handler=_run_build)

    add_commands(sub)
    add_infer_commands(sub)
    add_viz_commands(sub)
    add_generate_commands(sub)
    add_quantize_commands(sub)
    add_calibrate_commands(sub)
    add_eval_commands(sub)
    add_serve_commands(sub)
    add_exercises_commands(sub)

    bench = sub.add_parser("bench", help="run a benchmark and save its table and plot")
    bench_sub = bench.add_subparsers(dest="benchmark", metavar="NAME", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or "").strip()
        p = bench_sub.add_parser(name, help=doc.splitlines()[0], description=doc)
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
    return parser


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default where there is one: not for a required option, nor a
    None/False default ("(default: None)" after "all when not given" says less than the help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose help shows every option's default; sub-commands inherit it
    (argparse makes sub-parsers of the parent's class)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)


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


def _run_build(args: argparse.Namespace) -> int:
    try:
        native.build()
    except native.BuildError as error:
        print(f"attnlab build: {error}", file=sys.stderr)
        return 2 if isinstance(error, native.MissingToolError) else 1
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from attnlab.demo import run_attention_demo, run_date_demo

    if args.intro:
        run_attention_demo()
        return 0
    run_date_demo(args.out, retrain=args.retrain, steps=args.steps, batch_size=args.batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
