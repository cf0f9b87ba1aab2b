"""``attnlab exercises init DIR`` and ``attnlab exercises check [CHAPTER] [--dir DIR]``: the
course's exercises as stubs a learner fills in, and the tests that say what is still wrong."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnlab.cli import add_command
from attnlab.exercises.workspace import chapters, find_chapter, init_workspace, run_checks

MARKS = {"pass": "ok  ", "todo": "todo", "fail": "FAIL", "error": "ERR "}


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``exercises init`` and ``exercises check`` on the ``attnlab`` parser."""
    exercises = add_command(
        sub, "exercises", "Each tutorial's exercises as functions to fill in "
        "(exercises/chNN_*.py, made from the reference solutions shown on the pages) and their "
        "tests (exercises/tests/); `check` runs the tests, `pytest exercises/` too.")
    actions = exercises.add_subparsers(dest="action", metavar="ACTION", required=True)
    init = actions.add_parser("init", help="write the stubs and tests into DIR/exercises/",
                              description="Write every chapter's exercise stubs and their "
                              "tests into DIR/exercises/.")
    init.add_argument("dir", type=Path, help="the folder to write exercises/ into")
    init.add_argument("--force", action="store_true",
                      help="overwrite exercise files that exist (your work in them is lost)")
    init.set_defaults(handler=_run_init)
    check = actions.add_parser(
        "check", help="run the tests against your exercises (exit status 1 until all pass)",
        description="Run the tests against your exercises, one chapter or all (exit status 1 "
        "until all pass).")
    check.add_argument("chapter", nargs="?", default=None,
                       help=f"a chapter's number or module (all when not given): {chapters()}")
    check.add_argument("--dir", type=Path, default=Path("."),
                       help="the folder that holds exercises/ (the DIR of `exercises init`)")
    check.set_defaults(handler=_run_check)


def _run_init(args: argparse.Namespace) -> int:
    written = init_workspace(args.dir, force=args.force)
    stubs = sum(1 for p in written if p.parent.name == "exercises")
    print(f"wrote {stubs} exercise modules and their tests to {args.dir / 'exercises'}")
    print(f"fill them in, then run: attnlab exercises check --dir {args.dir}")
    return 0


def _run_check(args: argparse.Namespace) -> int:
    folder = args.dir / "exercises" if (args.dir / "exercises").is_dir() else args.dir
    if not folder.is_dir():
        raise ValueError(f"--dir: {args.dir} holds no exercises/; run "
                         f"`attnlab exercises init {args.dir}` first")
    names = [find_chapter(args.chapter)] if args.chapter else None
    counts = dict.fromkeys(MARKS, 0)
    for result in run_checks(folder, names):
        counts[result.status] += 1
        line = f"{MARKS[result.status]} {result.chapter}::{result.test}"
        print(f"{line}: {result.message}" if result.message else line)
    print(", ".join(f"{n} {status}" for status, n in counts.items() if n), file=sys.stderr)
    return 0 if counts["pass"] and counts["pass"] == sum(counts.values()) else 1
