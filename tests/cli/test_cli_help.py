"""The whole ``attnlab`` parser documents itself: every sub-command and option has a help text,
every help shows the defaults (where there is one: not None, not a flag's False), and
``--version`` / ``python -m attnlab`` work."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import attnlab
from attnlab.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
NO_DEFAULT = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def walk(parser: argparse.ArgumentParser, prog: str = "attnlab"):
    """``(prog, parser)`` for the parser and every sub-parser below it."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, f"{prog} {name}")


def test_walk_reaches_every_command():
    progs = {prog for prog, _ in walk(build_parser())}
    for expected in ("attnlab demo", "attnlab translate", "attnlab sample",
                     "attnlab train seq2seq", "attnlab bench qwen2", "attnlab bench families",
                     "attnlab bench variants"):
        assert expected in progs


def test_every_sub_command_has_a_help_line():
    missing = []
    for prog, parser in walk(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{prog} {c.dest}" for c in action._choices_actions
                            if not (c.help or "").strip()]
    assert not missing, f"sub-commands without help: {missing}"


def test_every_option_has_a_help_text_that_shows_its_default():
    problems = []
    for prog, parser in walk(build_parser()):
        formatter = parser._get_formatter()
        assert isinstance(formatter, argparse.ArgumentDefaultsHelpFormatter), prog
        for action in parser._actions:
            if isinstance(action, NO_DEFAULT):
                continue
            name = "/".join(action.option_strings) or action.dest
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                problems.append(f"{prog} {name}: no help")
                continue
            shown = formatter._get_help_string(action)
            has_default = action.default is not None and action.default is not False
            if (action.option_strings and not action.required and has_default
                    and "%(default)" not in shown):
                problems.append(f"{prog} {name}: help does not show the default")
            if not has_default and "%(default)" in shown:
                problems.append(f"{prog} {name}: shows a default it does not have")
            # A None default may be described by hand ("default: the checkpoint's").
            if has_default and "(default" in action.help.lower():
                problems.append(f"{prog} {name}: the default is written by hand as well")
    assert not problems, "\n".join(problems)


def test_version_matches_the_package_metadata_and_python_m_runs_the_cli():
    # (tomllib is not in Python 3.10, which the project supports)
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert version is not None and attnlab.__version__ == version.group(1)
    done = subprocess.run([sys.executable, "-m", "attnlab", "--version"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout == f"attnlab {attnlab.__version__}\n"
