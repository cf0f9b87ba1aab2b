"""``--threads`` and its default: every long-running command takes the same option, the count
runs (torch's threads), the default follows ``ATTNLAB_NUM_THREADS``, then ``OMP_NUM_THREADS``,
then the CPUs the process may use; bad values are refused by name; and demo, train and
generate say so when the machine is busy and they chose the count themselves."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab import threads
from attnlab.cli import bench as cli_bench
from attnlab.cli import build_parser, main
from attnlab.cli import demo as cli_demo
from attnlab.cli import train as cli_train
from attnlab.cli.bench import BENCHMARKS
from attnlab.threads import ENV, default_threads, use_threads

ROOT = Path(__file__).resolve().parents[2]

# Each command that takes --threads, with the options it requires.
COMMANDS = {
    "demo": ["demo"],
    "train seq2seq": ["train", "seq2seq", "--out", "run"],
    "train lm": ["train", "lm", "--text", "t.txt", "--out", "run"],
    "generate": ["generate", "--model", "m", "--prompt", "p"],
    "serve": ["serve", "--model", "m"],
    "viz": ["viz", "--checkpoint", "c", "--text", "t"],
    **{f"bench {name}": ["bench", name] for name in BENCHMARKS},
}


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """``use_threads`` sets torch's count for the whole process: put it back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_thread_variables(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Neither variable set (the session sets both to 1): the default is the usable CPUs."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return monkeypatch


def machine(monkeypatch: pytest.MonkeyPatch, *, cpus: int, load: float) -> None:
    """This process may use ``cpus`` CPUs and the 1-minute load average is ``load``."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_the_same_threads_option(command: str) -> None:
    parser = build_parser()
    assert parser.parse_args([*COMMANDS[command], "--threads", "3"]).threads == 3
    assert parser.parse_args(COMMANDS[command]).threads is None
    sub = parser
    for word in command.split():
        sub = next(a for a in sub._actions
                   if isinstance(a, argparse._SubParsersAction)).choices[word]
    option = next(a for a in sub._actions if "--threads" in a.option_strings)
    assert option.help == threads.HELP


@pytest.mark.parametrize("count", [1, 2])
def test_use_threads_sets_torch_threads(count: int) -> None:
    assert use_threads(count) == count
    assert torch.get_num_threads() == count


def test_threads_1_runs_one_thread_in_attnlab_generate(qwen2_folder) -> None:
    """A subprocess, where the environment asks for 2: the option wins, and generate's
    summary line reports torch's count."""
    env = {**os.environ, ENV: "2", "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "attnlab", "generate", "--model", str(qwen2_folder), "--prompt",
         "once upon a", "--max-new-tokens", "2", "--threads", "1"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stderr.rstrip().endswith(", 1 thread]"), done.stderr


def test_the_default_follows_attnlab_num_threads_then_omp_num_threads(monkeypatch) -> None:
    monkeypatch.setenv(ENV, "3")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert default_threads() == 3
    monkeypatch.delenv(ENV)
    assert default_threads() == 5
    assert use_threads(None) == 5 and torch.get_num_threads() == 5


def test_the_default_is_the_cpus_this_process_may_use(no_thread_variables) -> None:
    no_thread_variables.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5})
    no_thread_variables.setattr(os, "cpu_count", lambda: 64)
    assert default_threads() == 3
    no_thread_variables.delattr(os, "sched_getaffinity")  # not on Linux: every CPU
    assert default_threads() == 64


def test_an_omp_num_threads_that_torch_ignores_is_ignored(no_thread_variables) -> None:
    no_thread_variables.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    for text in ("0", "abc", "4,2"):
        no_thread_variables.setenv("OMP_NUM_THREADS", text)
        assert default_threads() == 2


@pytest.mark.parametrize("text", ["0", "-2", "abc", "1.5", "4,2"])
def test_a_bad_attnlab_num_threads_is_refused_by_name(text: str, monkeypatch, capsys) -> None:
    monkeypatch.setenv(ENV, text)
    with pytest.raises(ValueError, match=f"ATTNLAB_NUM_THREADS: expected a positive int "
                                         f"\\(torch threads\\), got '{text}'"):
        default_threads()
    ran = []
    monkeypatch.setattr(cli_demo, "_run_demo", ran.append)
    assert main(["demo"]) == 2
    assert f"attnlab: error: ATTNLAB_NUM_THREADS: expected a positive int (torch threads), " \
           f"got '{text}'" in capsys.readouterr().err
    assert not ran
    assert main(["demo", "--threads", "1"]) == 0  # the option, given, wins over the variable
    assert len(ran) == 1 and torch.get_num_threads() == 1


@pytest.mark.parametrize("text", ["0", "-1", "x", "1.5"])
@pytest.mark.parametrize("command", ["demo", "train lm", "generate", "serve", "viz",
                                     "bench serve"])
def test_a_bad_threads_option_is_refused_by_name(command: str, text: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*COMMANDS[command], "--threads", text])
    assert exit_.value.code == 2
    assert f"argument --threads: expected a positive int, got '{text}'" in \
        capsys.readouterr().err


def test_busy_note_when_the_load_exceeds_the_usable_cpus(no_thread_variables, capsys) -> None:
    machine(no_thread_variables, cpus=2, load=3.14)
    assert use_threads(None, note_when_busy=True) == 2
    err = capsys.readouterr().err
    assert err == ("attnlab: the machine is busy (load 3.1 on 2 CPUs): with --threads 1 this "
                   "may run several times faster than with 2 (OpenMP threads spin at barriers "
                   "when a core is taken)\n")


@pytest.mark.parametrize(("load", "given", "variable", "cpus"), [
    (1.9, None, None, 2),  # quiet
    (3.0, 2, None, 2),  # --threads given
    (3.0, None, "2", 2),  # ATTNLAB_NUM_THREADS set
    (3.0, None, None, 1),  # one CPU: one thread already
])
def test_no_busy_note_when_quiet_or_chosen(no_thread_variables, capsys, load, given, variable,
                                           cpus) -> None:
    machine(no_thread_variables, cpus=cpus, load=load)
    if variable:
        no_thread_variables.setenv(ENV, variable)
    use_threads(given, note_when_busy=True)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("command", "noted"), [
    ("demo", True), ("train lm", True), ("generate", True),
    ("serve", False), ("viz", False), ("bench generate", False),
])
def test_demo_train_and_generate_say_so_when_busy(command, noted, no_thread_variables,
                                                  tmp_path, capsys) -> None:
    """Each command stops at once (a missing file; the demo's work replaced): the note comes
    before any work, from demo, train and generate only."""
    machine(no_thread_variables, cpus=2, load=7.5)
    no_thread_variables.chdir(tmp_path)
    no_thread_variables.setattr(cli_demo, "_run_demo", lambda args: 0)
    no_thread_variables.setattr(cli_bench, "_bench_handler", lambda module: lambda args: 0)
    main(COMMANDS[command])
    err = capsys.readouterr().err
    assert ("attnlab: the machine is busy (load 7.5 on 2 CPUs)" in err) == noted, err
    assert torch.get_num_threads() == 2


def test_threads_are_no_part_of_a_training_run_s_recipe() -> None:
    """A run resumed with another --threads is the same run (``--resume`` compares the
    recipe's options)."""
    args = build_parser().parse_args([*COMMANDS["train lm"], "--threads", "2"])
    flags = cli_train._flags(args)
    assert "--threads" not in flags and "--steps" in flags
