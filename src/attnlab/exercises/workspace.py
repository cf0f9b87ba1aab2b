"""A learner's exercise folder: ``init_workspace`` writes the stubs and the tests,
``run_checks`` runs the tests against the learner's modules and says what is wrong.

The reference solutions (``chNN_*.py`` beside this file) are the one source: the course pages
include them, the tests check them, and the stubs are made from them by replacing the body of
each exercise (listed in the module's ``EXERCISES``) with ``raise NotImplementedError``, so
that a stub's signature and docstring cannot drift from the solution's.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from attnlab.exercises.checks import DIR_VARIABLE

HERE = Path(__file__).resolve().parent
TESTS = HERE / "tests"
SNIPPET_MARK = re.compile(r"^\s*# --8<-- \[(start|end):[\w.]+\]\s*$")


def chapters() -> list[str]:
    """The chapter modules' names in order: ``["ch01_attention", "ch02_masks", ...]``."""
    return sorted(p.stem for p in HERE.glob("ch[0-9][0-9]_*.py"))


def find_chapter(name: str) -> str:
    """The chapter that ``name`` means: a number (``"1"``, ``"01"``), ``"ch01"`` or the
    module's name."""
    wanted = name.removeprefix("ch").split("_")[0]
    for chapter in chapters():
        number = chapter[2:4]
        if name == chapter or (wanted.isdigit() and int(wanted) == int(number)):
            return chapter
    raise ValueError(f"chapter: no exercises for {name!r}; expected one of {chapters()} "
                     f"or its number")


def make_stub(source: str) -> str:
    """The stub of a solution module's source: every function or method named in its
    ``EXERCISES`` (``{"1.2": "my_attention", "5.1": "EncoderLayer.forward", ...}``; a value may
    be a list of names) keeps its signature and docstring, and its body becomes ``raise
    NotImplementedError``; the page-snippet markers are dropped. Everything else is kept."""
    tree = ast.parse(source)
    exercises = _exercises(tree)
    lines = source.splitlines()
    replacements = []  # (first line, last line, text), 1-based and inclusive
    for number, qualname in exercises:
        node = _find(tree, qualname)
        body = node.body
        has_doc = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                   and isinstance(body[0].value.value, str))
        if not has_doc or len(body) < 2:
            raise ValueError(f"exercise {number}: {qualname} needs a docstring and a body")
        start = body[0].end_lineno + 1
        indent = " " * body[1].col_offset
        text = f'{indent}raise NotImplementedError("exercise {number}: write {qualname}")'
        replacements.append((start, node.end_lineno, text))
    for start, end, text in sorted(replacements, reverse=True):
        lines[start - 1:end] = [text]
    return "\n".join(line for line in lines if not SNIPPET_MARK.match(line)) + "\n"


def init_workspace(dest: Path, *, force: bool = False) -> list[Path]:
    """Write ``dest/exercises/`` (a stub per chapter) and ``dest/exercises/tests/`` (the
    tests); returns the files written. An existing file is the learner's work: it is kept
    (and a ``FileExistsError`` names it) unless ``force``."""
    folder = Path(dest) / "exercises"
    files = {folder / f"{c}.py": make_stub((HERE / f"{c}.py").read_text(encoding="utf-8"))
             for c in chapters()}
    for test in sorted(TESTS.glob("test_*.py")):
        files[folder / "tests" / test.name] = test.read_text(encoding="utf-8")
    existing = [str(p) for p in files if p.exists()]
    if existing and not force:
        raise FileExistsError(f"dest: {len(existing)} exercise files exist already "
                              f"({existing[0]}, ...); pass --force to overwrite them")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return list(files)


@dataclass
class Result:
    """One test's outcome: ``status`` is ``"pass"``, ``"todo"`` (the exercise still raises
    NotImplementedError), ``"fail"`` (a check failed) or ``"error"`` (the code raised)."""

    chapter: str
    test: str
    status: str
    message: str = ""


def run_checks(folder: Path, chapter_names: list[str] | None = None) -> Iterator[Result]:
    """Run the tests of the chapters named (all when None) against the modules in
    ``folder`` (a workspace's ``exercises/``, or the folder that holds it), in order."""
    folder = Path(folder)
    if (folder / "exercises").is_dir():
        folder = folder / "exercises"
    for chapter in chapter_names or chapters():
        tests = _load(TESTS / f"test_{chapter}.py")
        with _exercises_dir(folder):
            for name, test in vars(tests).items():
                if name.startswith("test_") and callable(test):
                    yield _run(chapter, name, test)


def _run(chapter: str, name: str, test) -> Result:
    try:
        test()
    except NotImplementedError as error:
        return Result(chapter, name, "todo", f"not written yet ({error})")
    except AssertionError as error:
        return Result(chapter, name, "fail", str(error))
    except Exception as error:
        where = traceback.extract_tb(error.__traceback__)[-1]
        return Result(chapter, name, "error", f"{type(error).__name__}: {error} "
                      f"(at {Path(where.filename).name}:{where.lineno})")
    return Result(chapter, name, "pass")


@contextmanager
def _exercises_dir(folder: Path) -> Iterator[None]:
    before = os.environ.get(DIR_VARIABLE)
    os.environ[DIR_VARIABLE] = str(folder)
    try:
        yield
    finally:
        if before is None:
            del os.environ[DIR_VARIABLE]
        else:
            os.environ[DIR_VARIABLE] = before


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"_attnlab_exercise_tests_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exercises(tree: ast.Module) -> list[tuple[str, str]]:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and getattr(node.targets[0], "id", None) == "EXERCISES"):
            listed = ast.literal_eval(node.value)
            return [(number, name) for number, names in listed.items()
                    for name in ([names] if isinstance(names, str) else names)]
    raise ValueError("the solution module has no EXERCISES = {number: name, ...}")


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    scope: list[ast.stmt] = tree.body
    *owners, name = qualname.split(".")
    for owner in owners:
        scope = next(n.body for n in scope if isinstance(n, ast.ClassDef) and n.name == owner)
    for node in scope:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise ValueError(f"EXERCISES names {qualname!r}, which the module does not define")
