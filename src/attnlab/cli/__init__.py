"""The ``attnlab`` command line: one module of this package per command (``demo``, ``build``,
``train``, ``translate`` and ``sample`` (``infer``), ``viz``, ``generate``, ``quantize`` and
``export-gguf``, ``calibrate``, ``eval``, ``serve``, ``exercises``, ``bench``), each with
``add_commands(sub)``.

``COMMANDS`` names every command's module and its one-line help, so that ``attnlab --help``
and ``attnlab --version`` import no command module (none of the model stack, the server or a
benchmark), and ``attnlab NAME ...`` imports NAME's module only. Each command uses the
library's public API only and names the folder it wrote when it ends.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from attnlab import __version__
from attnlab.threads import use_threads

__all__ = ["COMMANDS", "Command", "add_command", "build_parser", "describe", "main"]


@dataclass(frozen=True)
class Command:
    """A top-level command: the module whose ``add_commands(sub)`` registers it, and the line
    that ``attnlab --help`` shows for it."""

    module: str
    help: str


COMMANDS = {
    "demo": Command("attnlab.cli.demo", "train a Transformer to translate dates into ISO 8601"),
    "build": Command("attnlab.cli.build", "compile attnlab's C++ kernels for this CPU (once; "
                     "1-3 min)"),
    "train": Command("attnlab.cli.train", "train a model (runs under torchrun too)"),
    "translate": Command("attnlab.cli.infer", "translate with a trained seq2seq checkpoint"),
    "sample": Command("attnlab.cli.infer", "sample text from a trained character-level LM "
                      "checkpoint"),
    "viz": Command("attnlab.cli.viz", "capture and draw a checkpoint's attention on a text"),
    "generate": Command("attnlab.cli.generate", "stream text from a Hugging Face-format "
                        "checkpoint folder (Llama, Qwen2 and the other families attnlab reads)"),
    "quantize": Command("attnlab.cli.quantize", "write a checkpoint folder's weights as int8 "
                        "or int4"),
    "export-gguf": Command("attnlab.cli.quantize", "write a checkpoint folder's model as a "
                           "GGUF file (llama.cpp, Ollama, transformers' gguf_file=)"),
    "calibrate": Command("attnlab.cli.calibrate", "measure the kernels for a model's shapes on "
                         "this machine and write the plan that loads then use"),
    "eval": Command("attnlab.cli.eval", "measure a model on text (perplexity, KL against a "
                    "reference)"),
    "serve": Command("attnlab.cli.serve", "serve a checkpoint folder over an OpenAI-compatible "
                     "HTTP API"),
    "exercises": Command("attnlab.cli.exercises", "write the course's exercise stubs, and check "
                         "your solutions"),
    "bench": Command("attnlab.cli.bench", "measure a model on this machine: generation, "
                     "serving, ours vs transformers, quantized accuracy"),
}
# The commands that say so when the machine is busy and no one chose the thread count. The
# others take --threads too: a benchmark records the load in its table instead, and a server
# outlives the load of the moment it starts.
NOTE_WHEN_BUSY = ("demo", "train", "generate")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnlab`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The first word that is not an option is the command (the top level has only --help and
    # --version): only its module is imported.
    command = next((word for word in argv if not word.startswith("-")), None)
    parser = build_parser([command] if command in COMMANDS else [])
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


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``attnlab`` parser. The modules of ``commands`` (every command when None) register
    their options; each other command is listed with its help line only."""
    wanted = {COMMANDS[name].module for name in (COMMANDS if commands is None else commands)}
    parser = _Parser(prog="attnlab", description=describe(
        "A Transformer toolkit for PyTorch: attention from the formulas up, models that load "
        "Hugging Face folders, training, generation, serving, quantization and looking inside."))
    parser.add_argument(
        "--version", action="version", version=f"attnlab {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    done: set[str] = set()
    for name, command in COMMANDS.items():
        if name in done:
            continue
        if command.module in wanted:
            # Imported by name so that a command's module (the model stack, the server) loads
            # only when that command runs.
            importlib.import_module(command.module).add_commands(sub)
            done |= {n for n, c in COMMANDS.items() if c.module == command.module}
        else:
            add_command(sub, name)
    return parser


def add_command(sub: argparse._SubParsersAction, name: str,
                description: str | None = None) -> argparse.ArgumentParser:
    """The sub-parser of the command ``name`` with its ``COMMANDS`` help line and
    ``description`` (``describe``'d; default: the help line as a sentence)."""
    line = COMMANDS[name].help
    return sub.add_parser(name, help=line,
                          description=describe(description or line[0].upper() + line[1:] + "."))


def describe(text: str, width: int = 88) -> str:
    """``text`` (a docstring) as a ``--help`` description: reST markup (double backticks,
    ``:role:`` prefixes) made plain, each paragraph wrapped whole (an indented one, a usage
    example, kept as written)."""
    text = re.sub(r":\w+:`", "`", inspect.cleandoc(text)).replace("``", "`")
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    return "\n\n".join(p if p.startswith(" ") else textwrap.fill(" ".join(p.split()), width)
                       for p in paragraphs)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter,
                         argparse.RawDescriptionHelpFormatter):
    """Shows an option's default where there is one: not for a required option, nor a
    None/False default ("(default: None)" after "all when not given" says less than the help).
    Descriptions are printed as ``describe`` wrapped them (paragraphs and examples kept)."""

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

