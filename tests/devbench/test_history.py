"""``write_with_history``: a benchmark's new table goes on top, earlier runs stay below it,
newest first, each headed by its machine and date."""

from __future__ import annotations

import pytest

from attnlab.bench.harness import machine_info, machine_section
from devbench.history import keep_history, write_with_history


def run_text(cpu: str, date: str, figure: str) -> str:
    info = {"cpu": cpu, "cores": "2", "measured": date}
    return "\n".join(["# Speed", "", f"ours {figure} tokens/s", *machine_section(info)])


def test_new_run_on_top_older_runs_below_newest_first(tmp_path) -> None:
    path = tmp_path / "t.md"
    write_with_history(path, run_text("AMD EPYC", "2026-01-01 10:00 UTC", "1"))
    assert "## History" not in path.read_text()
    write_with_history(path, run_text("Intel Xeon", "2026-02-01 10:00 UTC", "2"))
    write_with_history(path, run_text("Apple M3", "2026-03-01 10:00 UTC", "3"))
    text = path.read_text()
    current, history = text.split("\n## History\n")
    assert current.startswith("# Speed") and "ours 3 tokens/s" in current
    assert "ours 1" not in current and "ours 2" not in current
    heads = [line for line in history.splitlines() if line.startswith("### ")]
    assert heads == ["### Intel Xeon, 2026-02-01 10:00 UTC", "### AMD EPYC, 2026-01-01 10:00 UTC"]
    assert history.index("ours 2") < history.index("ours 1")
    assert history.count("#### Machine") == 2 and "\n## Machine" not in history
    assert text.count("# Speed") == 1


def test_an_old_table_without_date_or_title_is_kept(tmp_path) -> None:
    path = tmp_path / "t.md"
    path.write_text("| a | b |\n|---|---|\n| 1 | 2 |\n")
    write_with_history(path, run_text("AMD EPYC", "2026-01-01 10:00 UTC", "1"))
    history = path.read_text().split("\n## History\n")[1]
    assert "### machine not recorded" in history and "| 1 | 2 |" in history


def test_machine_info_says_when() -> None:
    assert machine_info()["measured"].endswith(" UTC")


def test_a_table_edited_into_bad_utf8_does_not_lose_the_new_run(tmp_path) -> None:
    path = tmp_path / "t.md"
    path.write_bytes(b"# Speed\n\nold \xff figure\n")
    write_with_history(path, run_text("AMD EPYC", "2026-01-01 10:00 UTC", "1"))
    current, history = path.read_text().split("\n## History\n")
    assert "ours 1 tokens/s" in current and "old \ufffd figure" in history


def test_a_run_killed_while_writing_leaves_the_table_and_its_history(tmp_path, monkeypatch):
    from attnlab import durable

    path = tmp_path / "qwen2.md"
    write_with_history(path, "# first\n\n- cpu: A\n- measured: 1\n")
    write_with_history(path, "# second\n\n- cpu: B\n- measured: 2\n")
    before = path.read_text()

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(durable.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_with_history(path, "# third\n\n- cpu: C\n- measured: 3\n")
    assert path.read_text() == before and "- cpu: A" in before
    assert [p.name for p in tmp_path.iterdir()] == ["qwen2.md"]  # no temporary file left


def test_keep_history_gives_each_rewritten_table_its_earlier_runs(tmp_path) -> None:
    """``python -m devbench`` wraps every run in it: a table the run rewrote keeps the runs it
    held below the new one; a table the run did not touch, and a new one, stay as they are."""
    (tmp_path / "sub").mkdir()
    rewritten, untouched = tmp_path / "a.md", tmp_path / "sub" / "b.md"
    rewritten.write_text(run_text("AMD EPYC", "2026-01-01 10:00 UTC", "1"))
    untouched.write_text("# b\n\nas it was\n")
    with keep_history(tmp_path):
        rewritten.write_text(run_text("Intel Xeon", "2026-02-01 10:00 UTC", "2"))
        (tmp_path / "c.md").write_text(run_text("Apple M3", "2026-03-01 10:00 UTC", "3"))
    current, history = rewritten.read_text().split("\n## History\n")
    assert "ours 2" in current and "ours 1" not in current
    assert history.lstrip().startswith("### AMD EPYC, 2026-01-01 10:00 UTC") and "ours 1" in history
    assert untouched.read_text() == "# b\n\nas it was\n"
    assert "## History" not in (tmp_path / "c.md").read_text()
    with keep_history(tmp_path / "missing"):  # a folder the run makes
        pass
