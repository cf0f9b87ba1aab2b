"""The whole ``attnlab`` parser documents itself: every sub-command and option has a help text,
every help shows the defaults (where there is one: not None, not a flag's False), every
command has a description in plain text, ``--help`` and ``--version`` import no command's
module, and ``--version`` / ``python -m attnlab`` work."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attnlab
from attnlab.cli import COMMANDS, build_parser, describe
from attnlab.cli.bench import first_sentence
from attnlab.cli.options import DTYPES, model_and_out

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


def test_every_command_has_a_description_in_plain_text():
    """No reST markup reaches a terminal, and ``attnlab NAME --help`` always says what NAME
    does (``demo``, ``train``, ``train seq2seq``, ``train lm`` and ``bench`` once did not)."""
    problems = []
    for prog, parser in walk(build_parser()):
        text = parser.format_help()
        if "``" in text or re.search(r":\w+:`", text):
            problems.append(f"{prog}: reST markup in its help")
        if prog != "attnlab" and not (parser.description or "").strip():
            problems.append(f"{prog}: no description")
    assert not problems, "\n".join(problems)


def test_a_help_line_taken_from_a_docstring_is_its_whole_first_sentence():
    bench = dict(walk(build_parser()))["attnlab bench"]
    for action in bench._subparsers._group_actions[0]._choices_actions:
        sub = bench._subparsers._group_actions[0].choices[action.dest]
        if sub.get_default("moved"):
            continue
        assert action.help == first_sentence(sub.description), action.dest
        assert " ".join(sub.description.split()).startswith(action.help), action.dest
    assert first_sentence("A b, c\nd e. F g.\n\nH.") == "A b, c d e"
    assert first_sentence("Qwen2 speed: ours vs transformers (sdpa), 1.5x faster.") == (
        "Qwen2 speed: ours vs transformers (sdpa), 1.5x faster")


def test_describe_makes_a_docstring_plain_and_wraps_its_paragraphs():
    text = describe('''``attnlab x``: does :class:`Y` and
    ``z``.

        attnlab x --flag  # an example, kept as written

    ''' + "word " * 30)
    assert text.startswith("`attnlab x`: does `Y` and `z`.\n\n    attnlab x --flag  # an example")
    assert all(len(line) <= 88 for line in text.splitlines())


def modules_after(argv: list[str]) -> set[str]:
    """The modules that ``attnlab ARGV`` has imported when it ends, in a fresh process."""
    code = ("import sys\nfrom attnlab.cli import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit:\n    pass\nprint(' '.join(sorted(sys.modules)), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=600)
    return set(done.stderr.split())


@pytest.mark.parametrize("argv", [["--help"], ["--version"], []])
def test_help_and_version_import_no_command_the_model_stack_or_the_server(argv):
    """``attnlab --help`` took 20 s on a busy machine when it imported every command."""
    loaded = modules_after(argv)
    assert "attnlab.cli" in loaded
    heavy = ("attnlab.models", "attnlab.serving", "attnlab.bench", "attnlab.training",
             "attnlab.generation", "attnlab.kernels", "attnlab.analysis", "attnlab.quantization",
             "attnlab.cli.", "uvicorn", "fastapi", "transformers", "devbench")
    found = sorted(m for m in loaded if m.startswith(heavy))
    assert not found, f"attnlab {' '.join(argv)} imported {found}"


def test_a_command_imports_its_own_module_only():
    loaded = modules_after(["exercises", "--help"])
    assert "attnlab.cli.exercises" in loaded
    assert not {"attnlab.cli.serve", "attnlab.cli.train", "attnlab.serving", "uvicorn"} & loaded


def test_a_checkpoint_folder_is_model_and_dtype_has_one_set_of_choices_everywhere():
    folder_commands = {"attnlab generate", "attnlab serve", "attnlab viz", "attnlab translate",
                       "attnlab sample", "attnlab quantize", "attnlab calibrate"}
    seen = set()
    for prog, parser in walk(build_parser()):
        for action in parser._actions:
            if "--model" in action.option_strings and prog in folder_commands:
                assert action.dest == "model", prog
                seen.add(prog)
            if "--checkpoint" in action.option_strings:  # an alias of --model only
                assert action.option_strings == ["--model", "--checkpoint"], prog
            if action.dest == "dtype":
                assert tuple(action.choices) == DTYPES, prog
    assert seen == folder_commands


def test_the_old_spellings_still_work():
    parser = build_parser()
    assert parser.parse_args(["viz", "--checkpoint", "d", "--text", "t"]).model == "d"
    assert parser.parse_args(["translate", "--checkpoint", "d", "x"]).model == "d"
    old = parser.parse_args(["quantize", "in", "out", "--bits", "4"])
    new = parser.parse_args(["quantize", "--model", "in", "--out", "out", "--bits", "4"])
    for args in (old, new):
        model_and_out(args, with_out=True)
        assert (args.model, args.out, args.bits) == ("in", "out", 4)
    calibrate = parser.parse_args(["calibrate", "in"])
    model_and_out(calibrate, with_out=False)
    assert calibrate.model == "in"
    for argv, message in [(["quantize", "in"], r"FOLDER OUT: expected 2 positional path"),
                          (["quantize", "in", "out", "--model", "x"], r"give the paths once"),
                          (["quantize", "--model", "in"], r"--out: required"),
                          (["quantize"], r"--model and --out: required")]:
        with pytest.raises(ValueError, match=message):
            model_and_out(parser.parse_args(argv), with_out=True)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_the_parser_of_one_command_lists_every_command(name):
    """``attnlab NAME ...`` builds NAME's options only; the others stay listed (a module that
    registers two commands, as infer does for translate and sample, registers them once)."""
    parser = build_parser([name])
    listed = parser._subparsers._group_actions[0].choices
    assert list(listed) == list(COMMANDS)
    assert len(listed[name]._actions) > 1 or name == "build"
