"""The course site's pages: every Python block is executed by the build, every check in a
block is an assertion that fails the build when false, and each Japanese page runs the code of
its English page (the prose, the code's comments and docstrings and the figure text are
translated)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from page_runner import BlockError, code_blocks, executed_blocks, run_page

from attnlab.cli import build_parser
from devbench.cli import build_parser as build_devbench_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SRC = ROOT / "src"
HOOK = ROOT / "docs_hooks" / "exec_cache.py"
TRANSLATED = ["index.md", "architecture.md", "usage.md", "glossary.md", "tutorials/index.md"]


def english_pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if not p.name.endswith(".ja.md"))


def test_code_blocks_parses_nested_and_indented_fences():
    text = "a\n```python exec=\"on\"\nx = 1\n```\n\n    ```bash\n    ls\n    ```\n"
    assert code_blocks(text) == [('python exec="on"', "x = 1"), ("bash", "ls")]
    with pytest.raises(ValueError, match="unclosed"):
        code_blocks("```python\nx = 1\n")


@pytest.mark.parametrize("page", english_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_python_block_is_executed(page: Path):
    for path in (page, page.with_suffix(".ja.md")):
        if not path.exists():
            continue
        for info, body in code_blocks(path.read_text(encoding="utf-8")):
            if info.split(" ")[0] in ("python", "py"):
                assert 'exec="on"' in info, (
                    f"{path.relative_to(DOCS)}: a python block that the build does not run "
                    f"(add exec=\"on\"): {body[:80]!r}"
                )


def tutorial_pages() -> list[Path]:
    return [p for p in english_pages() if p.parent.name == "tutorials" and p.name[:2].isdigit()]


def test_every_tutorial_and_page_has_a_japanese_version():
    missing = [
        str(p.relative_to(DOCS))
        for p in tutorial_pages() + [DOCS / name for name in TRANSLATED]
        if not p.with_suffix(".ja.md").exists()
    ]
    assert not missing, f"pages without a .ja.md translation: {missing}"
    assert len(tutorial_pages()) == 12


# Figure text that a Japanese page may translate: every string argument of these calls, and
# these keywords' string values in any call.
LABEL_CALLS = {"set_title", "set_xlabel", "set_ylabel", "suptitle", "text", "annotate"}
LABEL_KEYWORDS = {"label", "title", "xlabel", "ylabel"}


def runnable_code(info: str, body: str) -> str:
    """What a block does, for comparing an English block with its Japanese twin: a Python
    block's syntax tree with comments and docstrings left out and its figure text (titles,
    axis labels, legend labels) replaced by ``"<label>"``; any other block as it is."""
    if info.split(" ")[0] not in ("python", "py"):
        return f"{info}\n{body}"
    tree = ast.parse(body)

    def is_text(node: ast.AST) -> bool:
        return isinstance(node, ast.JoinedStr) or (
            isinstance(node, ast.Constant) and isinstance(node.value, str))

    label = ast.Constant("<label>")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if getattr(node.func, "attr", getattr(node.func, "id", None)) in LABEL_CALLS:
                node.args = [label if is_text(a) else a for a in node.args]
            for keyword in node.keywords:
                if keyword.arg in LABEL_KEYWORDS and is_text(keyword.value):
                    keyword.value = label
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and is_text(first.value):
                node.body = node.body[1:] or [ast.Pass()]
    return f"{info}\n{ast.dump(tree)}"


def test_runnable_code_sets_aside_comments_docstrings_and_figure_text():
    english = ('def f(x):\n    """Twice x."""\n    return 2 * x  # double\n'
               'ax.set_title(f"head {h}")\nax.plot(x, label="query")\nprint("done")\n')
    japanese = ('def f(x):\n    """x の 2 倍。"""\n    return 2 * x  # 2 倍する\n'
                'ax.set_title(f"ヘッド {h}")\nax.plot(x, label="クエリ")\nprint("done")\n')
    info = 'python exec="on"'
    assert runnable_code(info, english) == runnable_code(info, japanese)
    for changed in (japanese.replace("2 * x", "3 * x"), japanese.replace('"done"', '"完了"'),
                    japanese.replace("ax.plot(x,", "ax.plot(-x,")):
        assert runnable_code(info, english) != runnable_code(info, changed)
    assert runnable_code("bash", "ls  # list") != runnable_code("bash", "ls  # 一覧")


@pytest.mark.parametrize("page", tutorial_pages(), ids=lambda p: p.name)
def test_japanese_page_runs_the_same_code(page: Path):
    """Only comments, docstrings and figure text may be translated: the Japanese page runs
    the English page's code and prints what it prints."""
    english = code_blocks(page.read_text(encoding="utf-8"))
    japanese = code_blocks(page.with_suffix(".ja.md").read_text(encoding="utf-8"))
    assert len(japanese) == len(english), (
        f"{page.name}: {len(english)} code blocks in English, {len(japanese)} in Japanese"
    )
    for n, (en, ja) in enumerate(zip(english, japanese)):
        assert en[0] == ja[0] and runnable_code(*en) == runnable_code(*ja), (
            f"{page.name}: code block {n} differs between English and Japanese beyond "
            "comments, docstrings and figure text")


def shell_commands(body: str) -> list[list[str]]:
    """The command lines of a shell block: continuations joined, a quote left open carried
    into the next line, comments dropped, each split as the shell would (``shlex``)."""
    commands, pending = [], ""
    for line in body.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quotation still open: it goes on on the next line
            continue
        pending = ""
        if words:
            commands.append(words)
    if pending:
        raise ValueError(f"unclosed quotation in {pending!r}")
    return commands


def test_shell_commands_parses_continuations_and_comments():
    body = "attnlab demo --steps 2  # train\n# a comment\nattnlab viz \\\n    --text 'a # b'\n"
    assert shell_commands(body) == [["attnlab", "demo", "--steps", "2"],
                                    ["attnlab", "viz", "--text", "a # b"]]
    assert shell_commands("curl -d '{\n  \"a\": 1}'\nmake docs") == [
        ["curl", "-d", '{\n  "a": 1}'], ["make", "docs"]]
    with pytest.raises(ValueError, match="unclosed quotation"):
        shell_commands("echo 'a")


@pytest.mark.parametrize("page", english_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_command_line_on_a_page_is_one_the_cli_accepts(page: Path):
    """The shell blocks are not run (they name real checkpoints and full-size runs), but they
    cannot rot either: each ``attnlab`` line must parse with the real command line (and not
    name a benchmark that moved to devbench), each ``python -m devbench`` line with devbench's,
    each ``make`` target must exist."""
    parser, devbench_parser = build_parser(), build_devbench_parser()
    targets = set(re.findall(r"^([a-z][\w-]*):", (DOCS.parent / "Makefile").read_text(), re.M))
    for path in (page, page.with_suffix(".ja.md")):
        if not path.exists():
            continue
        for info, body in code_blocks(path.read_text(encoding="utf-8")):
            if info.split(" ")[0] not in ("bash", "sh", "console"):
                continue
            for words in shell_commands(body):
                where = f"{path.relative_to(DOCS)}: {' '.join(words)!r}"
                if words[0] == "attnlab":
                    try:
                        args = parser.parse_args(words[1:])
                    except SystemExit as exit_:
                        pytest.fail(f"{where} is refused by attnlab's parser ({exit_})")
                    assert not getattr(args, "moved", False), f"{where}: moved to devbench"
                elif words[:3] == ["python", "-m", "devbench"]:
                    try:
                        devbench_parser.parse_args(words[3:])
                    except SystemExit as exit_:
                        pytest.fail(f"{where} is refused by devbench's parser ({exit_})")
                elif words[0] == "make":
                    assert set(words[1:]) <= targets, f"{where}: no such make target"


# The pages' checks: a block states what it proves with `assert`, so a check that turns false
# fails the build (markdown-exec reports the exception, `mkdocs build --strict` stops on it)
# while the page still prints the value that the reader sees.
CHECKS = {"allclose", "equal", "isclose", "array_equal"}


def unasserted_checks(code: str) -> list[str]:
    """What a block compares without asserting: each ``allclose``/``equal``/``isclose`` call
    written inside a ``print(...)``, and, when the block has no ``assert`` at all, each one."""
    tree = ast.parse(code)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]

    def is_check(call: ast.Call) -> bool:
        return getattr(call.func, "attr", getattr(call.func, "id", None)) in CHECKS

    printed = [ast.unparse(inner) for call in calls
               if isinstance(call.func, ast.Name) and call.func.id == "print"
               for inner in ast.walk(call) if isinstance(inner, ast.Call) and is_check(inner)]
    if any(isinstance(node, ast.Assert) for node in ast.walk(tree)):
        return printed
    return printed + [ast.unparse(call) for call in calls if is_check(call)]


def test_unasserted_checks_finds_printed_and_unasserted_comparisons():
    assert unasserted_checks('print("ok:", torch.allclose(a, b))\nassert x') == [
        "torch.allclose(a, b)"]
    assert unasserted_checks("same = torch.equal(a, b)\nprint(same)") == ["torch.equal(a, b)"]
    assert unasserted_checks("same = torch.equal(a, b)\nprint(same)\nassert same") == []


@pytest.mark.parametrize("page", english_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_check_on_a_page_is_an_assertion(page: Path):
    for path in (page, page.with_suffix(".ja.md")):
        if not path.exists():
            continue
        for n, (_, code) in enumerate(executed_blocks(path.read_text(encoding="utf-8"))):
            found = unasserted_checks(code)
            assert not found, (
                f"{path.relative_to(DOCS)}, block {n}: a check that only prints, {found}; "
                "keep the value in a variable, print it and assert it")


def test_a_false_check_fails_the_page_run(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(FALSE_CHECK, encoding="utf-8")
    with pytest.raises(BlockError, match=r"block 1 .*\n(.*\n)*AssertionError: 1 \+ 1 is not 3"):
        run_page(page)
    page.write_text(FALSE_CHECK.replace("value == 3", "value == 2"), encoding="utf-8")
    assert run_page(page) == ["two: True\n", "three: True\n"]


FALSE_CHECK = '''# A page

```python exec="on" source="block" result="text" session="s"
value = 1 + 1
print("two:", value == 2)
```

??? success "Solution"
    ```python exec="on" source="block" result="text" session="s"
    ok = value == 3
    print("three:", ok)
    assert ok, "1 + 1 is not 3"
    ```
'''


def build_site(folder: Path, page: str, cache: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of a one-page site with markdown-exec and the docs' cache
    hook, as ``make docs`` builds the course."""
    (folder / "docs").mkdir(parents=True, exist_ok=True)
    (folder / "docs" / "index.md").write_text(page, encoding="utf-8")
    (folder / "mkdocs.yml").write_text(
        "site_name: check\ntheme: {name: mkdocs}\n"
        "markdown_extensions: [admonition, pymdownx.details, pymdownx.superfences]\n"
        f"plugins: [markdown-exec]\nhooks: [{HOOK}]\n", encoding="utf-8")
    env = {**os.environ, "ATTNLAB_DOCS_CACHE": str(cache), "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(folder / "mkdocs.yml")],
        capture_output=True, text=True, env=env, timeout=600, check=False)


def test_a_false_check_fails_the_strict_build_every_time(tmp_path: Path):
    cache = tmp_path / "cache"
    for _ in range(2):  # a failed page is never cached: the second build runs it again
        failed = build_site(tmp_path / "site", FALSE_CHECK, cache)
        assert failed.returncode != 0, failed.stderr
        assert "AssertionError: 1 + 1 is not 3" in failed.stderr, failed.stderr
    assert not list(cache.glob("*.json"))
    fixed = build_site(tmp_path / "site", FALSE_CHECK.replace("value == 3", "value == 2"), cache)
    assert fixed.returncode == 0, fixed.stderr
    assert "three: True" in (tmp_path / "site" / "site" / "index.html").read_text()


def test_the_build_replays_a_page_until_its_code_changes(tmp_path: Path):
    """The cache hook runs a page's blocks once; a second build shows the same output without
    running them, and a changed block runs the page again."""
    runs, cache = tmp_path / "runs.txt", tmp_path / "cache"
    page = ('```python exec="on" result="text" session="c"\n'
            f"with open({str(runs)!r}, 'a') as f:\n    f.write('x')\n"
            'print("ran")\n```\n')
    html = tmp_path / "site" / "site" / "index.html"
    for _ in range(2):
        built = build_site(tmp_path / "site", page, cache)
        assert built.returncode == 0, built.stderr
        assert "ran" in html.read_text()
    assert runs.read_text() == "x"
    assert "1 pages replayed" in built.stderr
    built = build_site(tmp_path / "site", page.replace('"ran"', '"ran again"'), cache)
    assert built.returncode == 0, built.stderr
    assert runs.read_text() == "xx"
    assert "ran again" in html.read_text()


def test_a_page_that_prints_a_benchmark_table_runs_again_when_the_table_changes(
        tmp_path: Path):
    """A block that reads ``benchmarks/table.md`` (named in its code) is replayed while the
    table is unchanged and runs again once it changes."""
    cache, site = tmp_path / "cache", tmp_path / "site"
    table = site / "benchmarks" / "table.md"
    table.parent.mkdir(parents=True)
    table.write_text("| KL | 0.098 |\n")
    page = ('```python exec="on" result="text" session="b"\n'
            f"print(open({str(table)!r}).read())\n```\n")
    html = site / "site" / "index.html"
    for _ in range(2):
        built = build_site(site, page, cache)
        assert built.returncode == 0, built.stderr
    assert "1 pages replayed" in built.stderr and "0.098" in html.read_text()
    table.write_text("| KL | 0.080 |\n")
    built = build_site(site, page, cache)
    assert built.returncode == 0, built.stderr
    assert "0 pages replayed" in built.stderr and "0.080" in html.read_text()


def test_the_cache_key_sets_comments_aside(tmp_path: Path):
    """A Japanese page whose blocks differ from the English ones only in comments replays the
    English page's outputs: the key is the same."""
    spec = importlib.util.spec_from_file_location("exec_cache", HOOK)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    english = "# the scores\nx = 1  # one\nprint(x)\n"
    assert hook.without_comments(english) == hook.without_comments("# スコア\nx = 1\nprint(x)\n")
    assert hook.without_comments(english) != hook.without_comments("x = 2\nprint(x)\n")
    assert hook.without_comments("print('a  # b')") != hook.without_comments("print('a')")
    assert hook.without_comments("x = (1,") == "x = (1,"  # kept as it is when it cannot tokenize


def test_the_cache_key_covers_every_file_of_the_library(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("exec_cache", HOOK)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    package = tmp_path / "attnlab"
    (package / "kernels").mkdir(parents=True)
    (package / "kernels" / "gemv.cpp").write_text("int f();")
    before = hook.library_hash(package)
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "x.pyc").write_bytes(b"compiled")
    assert hook.library_hash(package) == before
    (package / "kernels" / "gemv.cpp").write_text("int g();")
    assert hook.library_hash(package) != before
    page = 'x\n```python exec="on" session="a"\nprint(1)\n```\n    ```bash\n    ls\n    ```\n'
    assert hook.executed_blocks(page) == [['python exec="on" session="a"', "print(1)"]]
