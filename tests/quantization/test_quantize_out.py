"""``attnlab quantize FOLDER OUT`` never overwrites by surprise: an OUT holding the user's
files or another folder's quantized weights is refused unless ``--force``, an earlier output
for the same FOLDER is replaced, and an interrupted run leaves OUT absent or as it was."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat

import pytest

from attnlab.cli import main
from attnlab.cli import quantize as cli_quantize
from attnlab.models.io import from_pretrained
from tiny_folders import make_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two different float models."""
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    make_folder(a)
    make_folder(b)
    return a, b


def contents(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_an_out_holding_other_files_is_refused_unless_force(folders, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["quantize", str(folders[0]), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"out: {out} already holds files that attnlab quantize did not write (notes.txt)" \
        in err and "--force" in err
    assert contents(out) == {"notes.txt": b"mine"}
    assert main(["quantize", str(folders[0]), str(out), "--force"]) == 0
    assert "notes.txt" not in contents(out)
    assert from_pretrained(out).quantization.method == "int8"


def test_another_folders_output_is_refused_and_the_same_folders_is_replaced(folders, tmp_path,
                                                                            capsys):
    a, b = folders
    out = tmp_path / "out"
    assert main(["quantize", str(a), str(out)]) == 0
    assert json.loads((out / "quantized_from.json").read_text()) == {
        "format": "attnlab-quantize", "source": str(a.resolve())}
    before = contents(out)
    capsys.readouterr()
    assert main(["quantize", str(b), str(out), "--bits", "4", "--group-size", "32"]) == 2
    assert f"already holds the quantized weights of another folder, {a.resolve()}" in \
        capsys.readouterr().err
    assert contents(out) == before
    # the same FOLDER again (with other options): its earlier output is replaced
    assert main(["quantize", str(a), str(out), "--bits", "4", "--group-size", "32"]) == 0
    assert from_pretrained(out).quantization.method == "int4"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no hidden leftovers


def test_an_empty_out_is_written_and_a_file_is_refused(folders, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["quantize", str(folders[0]), str(tmp_path / "empty")]) == 0
    (tmp_path / "file").write_text("x")
    assert main(["quantize", str(folders[0]), str(tmp_path / "file"), "--force"]) == 2
    assert "is a file; expected a folder" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("earlier", [False, True])
def test_an_interrupted_run_leaves_out_absent_or_intact(folders, tmp_path, monkeypatch,
                                                        earlier):
    a = folders[0]
    out = tmp_path / "out"
    if earlier:
        assert main(["quantize", str(a), str(out)]) == 0
        before = contents(out)

    def interrupted(*args, **kwargs):  # the weights are written, the side files not yet
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_quantize.shutil, "copyfile", interrupted)
    assert main(["quantize", str(a), str(out), "--bits", "4", "--group-size", "32"]) == 130
    if earlier:
        assert contents(out) == before
        assert from_pretrained(out).quantization.method == "int8"
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if earlier else [])


def test_a_killed_runs_leftover_is_removed_by_the_next(folders, tmp_path):
    out = tmp_path / "out"
    leftover = tmp_path / ".out.tmp-killed"
    leftover.mkdir()
    shutil.copyfile(folders[0] / "config.json", leftover / "config.json")
    assert main(["quantize", str(folders[0]), str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_out_follows_the_users_umask(folders, tmp_path):
    previous = os.umask(0o022)
    try:
        assert main(["quantize", str(folders[0]), str(tmp_path / "out")]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()} == {0o644}


def test_an_out_holding_folder_is_refused_even_with_force(tmp_path, capsys):
    source = tmp_path / "out" / "model"
    source.mkdir(parents=True)
    make_folder(source)
    assert main(["quantize", str(source), str(tmp_path / "out"), "--force"]) == 2
    assert "holds FOLDER" in capsys.readouterr().err
    assert (source / "model.safetensors").is_file()


def test_a_full_disk_leaves_out_as_it_was_in_one_line(folders, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(["quantize", str(folders[0]), str(out)]) == 0
    before = contents(out)
    capsys.readouterr()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cli_quantize.shutil, "copyfile", disk_full)
    assert main(["quantize", str(folders[0]), str(out), "--bits", "4", "--group-size", "32"]) == 2
    err = capsys.readouterr().err
    error = err.strip().splitlines()[-1]  # after the "loading ..." progress line
    assert "Traceback" not in err and "No space left on device" in error
    assert f"cannot write {out}" in error and "it is as it was before" in error
    assert contents(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("target", ["missing", "empty", "earlier"])
def test_an_out_that_is_a_link_is_written_at_its_target(folders, tmp_path, target):
    """A link to another disk's folder (missing, empty, or an earlier output) gets the model
    in that folder, and the link stays a link (it was replaced by a folder beside it, or the
    run failed at its end on a missing target)."""
    real, link = tmp_path / "disk" / "q", tmp_path / "q"
    real.parent.mkdir()
    if target == "empty":
        real.mkdir()
    elif target == "earlier":
        assert main(["quantize", str(folders[0]), str(real)]) == 0
    link.symlink_to(real)
    assert main(["quantize", str(folders[0]), str(link), "--bits", "4",
                 "--group-size", "32"]) == 0
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert from_pretrained(real).quantization.method == "int4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "q"]  # no leftovers
    assert sorted(p.name for p in real.parent.iterdir()) == ["q"]
