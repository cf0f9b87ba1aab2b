"""The course's exercises: the reference solutions pass their tests, the stubs made from them
fail with a message that names the exercise, a wrong answer is told what differs, the pages
show the solution files the tests check, and the command line and pytest both run them."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.exercises import workspace
from attnlab.exercises.checks import assert_close, assert_equal

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = ROOT / "docs" / "tutorials"
SNIPPET = re.compile(r'^\s*--8<-- "(ch\d\d_\w+)\.py:(\w+)"\s*$', re.M)


def test_the_reference_solutions_pass_every_check():
    results = list(workspace.run_checks(workspace.HERE))
    assert results
    failed = [(r.test, r.message) for r in results if r.status != "pass"]
    assert not failed, f"reference solutions that fail their own tests: {failed}"


def test_every_stub_fails_with_a_message_that_names_its_exercise(tmp_path):
    workspace.init_workspace(tmp_path)
    results = list(workspace.run_checks(tmp_path))
    assert {r.status for r in results} == {"todo"}, [r for r in results if r.status != "todo"]
    for r in results:
        number = r.test.split("_")[1:3]  # test_1_2_... checks exercise 1.2
        assert f"exercise {number[0]}.{number[1]}: write " in r.message, r


def test_a_stub_keeps_signature_and_docstring_and_drops_the_body():
    source = (workspace.HERE / "ch01_attention.py").read_text(encoding="utf-8")
    stub = workspace.make_stub(source)
    assert "def my_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None)" in stub
    assert '"""softmax(q kᵀ / √D, masked) v' in stub
    assert "masked_fill" not in stub and "--8<--" not in stub
    assert 'raise NotImplementedError("exercise 1.2: write my_attention")' in stub


def test_make_stub_replaces_a_method_body_and_refuses_a_missing_name():
    source = ('EXERCISES = {"5.1": "Layer.forward"}\n\nclass Layer:\n    def __init__(self):\n'
              '        self.a = 1\n\n    def forward(self, x):\n        """x + a."""\n'
              '        y = x\n        return y + self.a\n')
    stub = workspace.make_stub(source)
    assert "self.a = 1" in stub and "return y" not in stub
    assert '        raise NotImplementedError("exercise 5.1: write Layer.forward")' in stub
    with pytest.raises(ValueError, match="does not define"):
        workspace.make_stub('EXERCISES = {"1.1": "missing"}\n')


def test_a_wrong_answer_is_told_the_first_differing_element(tmp_path):
    workspace.init_workspace(tmp_path)
    module = tmp_path / "exercises" / "ch01_attention.py"
    text = module.read_text(encoding="utf-8").replace(
        'raise NotImplementedError("exercise 1.2: write my_attention")',
        "return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v  # no 1/sqrt(D)")
    module.write_text(text, encoding="utf-8")
    results = {r.test: r for r in workspace.run_checks(tmp_path, ["ch01_attention"])}
    wrong = results["test_1_2_my_attention_matches_the_library"]
    assert wrong.status == "fail"
    assert "my_attention, q (4, 8)" in wrong.message
    assert "the first differing element is at index (" in wrong.message


def test_assert_close_and_assert_equal_say_what_differs():
    with pytest.raises(AssertionError, match=r"out: shape \(2, 3\), expected \(3, 2\)"):
        assert_close(torch.zeros(2, 3), torch.zeros(3, 2), name="out")
    with pytest.raises(AssertionError, match=r"expected a torch\.Tensor, got list$"):
        assert_close([1.0], torch.zeros(1))
    with pytest.raises(AssertionError, match=r"dtype torch\.float64, expected torch\.float32"):
        assert_close(torch.zeros(2, dtype=torch.float64), torch.zeros(2))
    expected = torch.zeros(2, 3)
    actual = expected.clone()
    actual[1, 2] = 0.5
    with pytest.raises(AssertionError, match=r"1 of 6 elements differ .* index \(1, 2\): "
                                              r"got 0\.5, expected 0"):
        assert_close(actual, expected)
    assert_close(expected + 1e-7, expected)
    with pytest.raises(AssertionError, match="got 3, expected 4"):
        assert_equal(3, 4)
    with pytest.raises(AssertionError, match=r"the first at index \(1,\): got False"):
        assert_equal(torch.tensor([True, False]), torch.tensor([True, True]))


def test_init_keeps_the_learners_work_unless_forced(tmp_path):
    written = workspace.init_workspace(tmp_path)
    assert tmp_path / "exercises" / "tests" / "test_ch01_attention.py" in written
    mine = tmp_path / "exercises" / "ch01_attention.py"
    mine.write_text("# my work\n", encoding="utf-8")
    with pytest.raises(FileExistsError, match="--force"):
        workspace.init_workspace(tmp_path)
    assert mine.read_text(encoding="utf-8") == "# my work\n"
    workspace.init_workspace(tmp_path, force=True)
    assert "def my_attention" in mine.read_text(encoding="utf-8")


def test_find_chapter_accepts_a_number_or_a_name():
    assert workspace.find_chapter("1") == workspace.find_chapter("ch01") == "ch01_attention"
    assert workspace.find_chapter("ch01_attention") == "ch01_attention"
    with pytest.raises(ValueError, match="chapter: no exercises for '99'"):
        workspace.find_chapter("99")


def test_the_command_line_inits_and_checks(tmp_path, capsys):
    assert main(["exercises", "init", str(tmp_path)]) == 0
    assert "attnlab exercises check --dir" in capsys.readouterr().out
    assert main(["exercises", "check", "1", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "todo ch01_attention::test_1_2_my_attention_matches_the_library: not written yet" in out
    assert main(["exercises", "check", "1", "--dir", str(workspace.HERE)]) == 0
    assert main(["exercises", "check", "--dir", str(tmp_path / "nowhere")]) == 2
    assert "holds no exercises/" in capsys.readouterr().err


def test_pytest_runs_a_learners_folder(tmp_path):
    """``pytest exercises/`` in the learner's folder: the stubs fail, the solutions pass."""
    workspace.init_workspace(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("ATTNLAB_EXERCISES_DIR", None)
    command = [sys.executable, "-m", "pytest", "exercises", "-q", "-p", "no:cacheprovider",
               "-k", "test_1_"]
    stubs = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert stubs.returncode == 1, stubs.stdout[-2000:]
    assert "NotImplementedError: exercise 1.2: write my_attention" in stubs.stdout
    for chapter in workspace.chapters():
        (tmp_path / "exercises" / f"{chapter}.py").write_bytes(
            (workspace.HERE / f"{chapter}.py").read_bytes())
    solved = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert solved.returncode == 0, solved.stdout[-2000:]


@pytest.mark.parametrize("chapter", workspace.chapters())
def test_every_exercise_of_a_chapter_has_a_solution_on_its_page(chapter):
    """One source: each exercise's solution on the page (English and Japanese) is included
    from the module the tests check, and the page has as many exercises as the module."""
    source = (workspace.HERE / f"{chapter}.py").read_text(encoding="utf-8")
    exercises = workspace._exercises(ast.parse(source))
    numbers = {number for number, _ in exercises}
    page = next(TUTORIALS.glob(f"{chapter[2:4]}-*.md"))
    for path in (page, page.with_suffix("").with_suffix(".ja.md")):
        text = path.read_text(encoding="utf-8")
        solutions = text.count('??? success "Solution"') + text.count('??? success "解答"')
        assert solutions == len(numbers), (
            f"{path.name}: {solutions} exercises, {len(numbers)} in {chapter}")
        included = {(m[1], m[2]) for m in SNIPPET.finditer(text)}
        sections = set(re.findall(r"# --8<-- \[start:(\w+)\]", source))
        assert {(chapter, s) for s in sections} <= included, (
            f"{path.name} does not include {sorted(sections - {s for _, s in included})}")
