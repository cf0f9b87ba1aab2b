"""How the native kernels are built and found (``attnlab.kernels.native``): asking for them
only loads a library that ``attnlab build`` compiled, and says why when there is none; the
build says what it does in one line before and one after, happens once, is shared by two
checkouts of the same sources, and survives a builder killed midway. The compiler is a
stand-in here (``cpp_extension.load`` replaced) except in the first test, which needs one."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch
from kernel_helpers import own_cache_fixture  # noqa: F401  (autouse: a fresh cache a test)
from torch.utils import cpp_extension

from attnlab import cli
from attnlab.kernels import cache, native

# Hang guards only, far above the time anything here takes.
_BUILD_GUARD_S = 1800
_GUARD_S = 600


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a new one: nothing loaded yet, the switch unset."""
    monkeypatch.setattr(native, "_BUILT", [])
    monkeypatch.delenv("ATTNLAB_NATIVE", raising=False)


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch, fresh) -> list[dict]:
    """``cpp_extension.load`` replaced by a stand-in that writes a file where the library
    would be (and a compiler and ninja taken as present) -> the arguments of each call."""
    calls: list[dict] = []

    def load(**kwargs) -> types.ModuleType:
        calls.append(kwargs)
        library = Path(kwargs["build_directory"]) / f"{kwargs['name']}.so"
        library.write_bytes(b"a library")
        module = types.ModuleType(kwargs["name"])
        module.__file__ = str(library)
        return module

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(native, "_tools", lambda: "")
    return calls


def test_the_kernels_build_here(tmp_path: Path) -> None:
    """Where a C++ compiler is installed, the real build works from an empty cache: the
    session's (``make test`` runs ``attnlab build`` first), else one made here by the command,
    whose second call finds it built. A build that fails fails this test, never a skip."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler!r} not on the PATH): the native kernels "
                    "cannot be built here")
    if native.available():
        assert Path(native._extension().__file__).stat().st_size > 0
        return
    env = {**os.environ, "ATTNLAB_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "attnlab", "build"]
    first = subprocess.run(command, capture_output=True, text=True, env=env,
                           timeout=_BUILD_GUARD_S)
    assert first.returncode == 0, first.stderr
    assert "attnlab build: built in" in first.stderr
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=_GUARD_S)
    assert again.returncode == 0 and "attnlab build: already built:" in again.stderr


def test_asking_for_the_kernels_compiles_nothing_and_says_why(monkeypatch, fresh) -> None:
    def compiler(*args, **kwargs):
        raise AssertionError("a compiler or another program was started")

    monkeypatch.setattr(cpp_extension, "load", compiler)
    monkeypatch.setattr(subprocess, "Popen", compiler)
    assert not native.available()
    assert not native.takes(torch.ones(2, 8))
    assert native.unavailable_reason() == "not built: run `attnlab build`"
    with pytest.raises(RuntimeError, match="not available: not built: run `attnlab build`"):
        native.rms_norm(torch.ones(1, 8), torch.ones(8), 1e-6)
    assert not native.library_file().parent.exists()  # not even a folder made


def test_a_fresh_process_imports_attnlab_and_runs_rmsnorm_without_a_compiler(
        tmp_path: Path) -> None:
    """Importing attnlab and running ``RMSNorm(8)(x)`` (with no gradient, where the
    kernels would be taken) starts no program, in a process of its own with an empty cache."""
    code = textwrap.dedent("""
        import subprocess
        from torch.utils import cpp_extension
        def started(*args, **kwargs):
            raise SystemExit("a compiler or another program was started")
        subprocess.Popen = cpp_extension.load = started
        import torch
        import attnlab
        from attnlab.kernels import native
        from attnlab.layers import RMSNorm
        with torch.no_grad():
            RMSNorm(8)(torch.randn(2, 8))
        print(native.available(), native.unavailable_reason(), sep="; ")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=_GUARD_S, env={**os.environ, "ATTNLAB_CACHE_DIR":
                                                 str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False; not built: run `attnlab build`"
    assert "attnlab build" not in done.stderr  # nothing built, nothing announced


def test_attnlab_build_compiles_once_then_says_already_built(compiles, capsys) -> None:
    """One line before the compile and one after it; the second call compiles nothing and
    says so at once. The compiler reads copies of the sources kept in the build folder."""
    folder = native.library_file().parent
    assert cli.main(["build"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (f"attnlab build: compiling the native kernels for {cache.cpu_model()} "
                        f"(once per CPU and torch, about 1-3 min) in {folder}")
    assert re.fullmatch(rf"attnlab build: built in \d+ s: {re.escape(str(folder))}", lines[1])
    assert len(lines) == 2
    assert native.library_file().read_bytes() == b"a library"
    [call] = compiles
    assert call["name"] == native.library_file().name.removesuffix(".so")
    assert all(Path(s).parent == folder / "src" for s in call["sources"])
    assert Path(call["build_directory"]).parent == folder
    assert sorted(p.name for p in (folder / "src").iterdir()) == sorted(
        p.name for p in native._SOURCES + native._HEADERS)
    assert cli.main(["build"]) == 0
    assert capsys.readouterr().err == f"attnlab build: already built: {folder}\n"
    assert len(compiles) == 1


def _checkout(folder: Path, change: bytes = b"") -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """A copy of the kernel sources in ``folder`` (as another clone has them), ``change``
    appended to the last source file -> (sources, headers)."""
    folder.mkdir()
    for source in native._SOURCES + native._HEADERS:
        shutil.copyfile(source, folder / source.name)
    if change:
        with open(folder / native._SOURCES[-1].name, "ab") as last:
            last.write(change)
    return (tuple(folder / p.name for p in native._SOURCES),
            tuple(folder / p.name for p in native._HEADERS))


def test_two_checkouts_of_the_same_sources_share_one_build(compiles, monkeypatch, tmp_path,
                                                           capsys) -> None:
    """The build folder and what is compiled there depend on the sources' content, not on
    where they lie: the second checkout finds the first one's build and compiles nothing;
    a checkout with other sources gets a folder of its own."""
    folders = []
    for name, change in (("one", b""), ("two", b""), ("three", b"// changed\n")):
        sources, headers = _checkout(tmp_path / name, change)
        monkeypatch.setattr(native, "_SOURCES", sources)
        monkeypatch.setattr(native, "_HEADERS", headers)
        folders.append(native.build())
    assert folders[0] == folders[1] != folders[2]
    assert "already built" in capsys.readouterr().err.splitlines()[2]
    assert len(compiles) == 2
    for call in compiles:
        assert all(str(tmp_path / "one") not in s and str(tmp_path / "three") not in s
                   for s in call["sources"])


def test_without_a_compiler_the_command_says_what_is_missing(monkeypatch, fresh, tmp_path,
                                                             capsys) -> None:
    def compiler(**kwargs):
        raise AssertionError("compiled without the tools")

    monkeypatch.setattr(cpp_extension, "load", compiler)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no c++, no ninja
    monkeypatch.delenv("CXX", raising=False)
    assert cli.main(["build"]) == 2
    assert capsys.readouterr().err.startswith(
        "attnlab build: no C++ compiler: 'c++' is not on the PATH")
    monkeypatch.setenv("CXX", sys.executable)  # a program, but no ninja anywhere
    monkeypatch.setattr(native, "_ninja_folder", lambda: "")
    assert cli.main(["build"]) == 2
    assert "attnlab build: no ninja" in capsys.readouterr().err
    monkeypatch.setenv("ATTNLAB_NATIVE", "0")
    assert cli.main(["build"]) == 2
    assert "ATTNLAB_NATIVE=0 switches the native kernels off" in capsys.readouterr().err


def test_a_failed_compile_is_reported_and_tried_again(compiles, monkeypatch, capsys) -> None:
    """Exit status 1 and the compiler's last line; later processes give it as the reason;
    the next ``attnlab build`` compiles again."""
    def fails(**kwargs):
        raise RuntimeError("Error building extension 'attnlab_native'\n"
                           "native_gemv.cpp:1:1: error: something is wrong")

    stand_in = cpp_extension.load
    monkeypatch.setattr(cpp_extension, "load", fails)
    assert cli.main(["build"]) == 1
    assert ("did not build: native_gemv.cpp:1:1: error: something is wrong"
            in capsys.readouterr().err)
    failed = native.library_file().with_name("build-failed.txt")
    assert "Error building extension" in failed.read_text()
    assert not native.available()
    assert native.unavailable_reason() == ("build failed: native_gemv.cpp:1:1: error: "
                                           "something is wrong (`attnlab build` tries again)")
    monkeypatch.setattr(cpp_extension, "load", stand_in)
    assert cli.main(["build"]) == 0
    assert len(compiles) == 1 and not failed.exists()


# A builder in a process of its own, with a stand-in compiler: "hang" leaves what a build
# killed midway leaves (torch's `lock`, half a library) and waits to be killed; "build"
# checks that it starts in an empty folder and finishes.
_BUILDER = textwrap.dedent("""
    import sys, time, types
    from pathlib import Path
    from torch.utils import cpp_extension
    from attnlab.kernels import native

    def load(name, sources, build_directory, **kwargs):
        work = Path(build_directory)
        assert not list(work.iterdir()), sorted(work.iterdir())
        library = work / f"{name}.so"
        (work / "lock").write_text("")
        library.write_bytes(b"half a lib")
        if sys.argv[1] == "hang":
            print("compiling", flush=True)
            time.sleep(3600)
        library.write_bytes(b"a library")
        module = types.ModuleType(name)
        module.__file__ = str(library)
        return module

    cpp_extension.load = load
    native._tools = lambda: ""
    native.build()
""")


def test_a_build_killed_midway_does_not_hang_the_next_build(tmp_path: Path) -> None:
    """A second builder waits for the first one (saying so) and, when the first is killed
    midway, builds from a clean folder; the library appears whole."""
    env = {**os.environ, "ATTNLAB_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("ATTNLAB_NATIVE", None)
    first = subprocess.Popen([sys.executable, "-c", _BUILDER, "hang"], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    second = None
    try:
        assert first.stdout.readline().strip() == "compiling"
        log = tmp_path / "second.err"
        with open(log, "w") as err:
            second = subprocess.Popen([sys.executable, "-c", _BUILDER, "build"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + _GUARD_S
        while "waiting for another process" not in log.read_text():
            assert second.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the second builder never said it waits"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=_GUARD_S)
        assert second.wait(timeout=_GUARD_S) == 0, log.read_text()
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert "attnlab build: built in" in log.read_text()
    env_library = subprocess.run(
        [sys.executable, "-c", "from attnlab.kernels import native; print(native.library_file())"],
        env=env, capture_output=True, text=True, timeout=_GUARD_S).stdout.strip()
    assert Path(env_library).read_bytes() == b"a library"


def test_switched_off_by_the_environment(monkeypatch, fresh) -> None:
    """Read when the kernels are first asked for (a fresh process: nothing loaded)."""
    monkeypatch.setenv("ATTNLAB_NATIVE", "0")
    assert not native.available()
    assert native.unavailable_reason() == "ATTNLAB_NATIVE=0"
    assert native.build_id() == "off"
    with pytest.raises(RuntimeError, match="not available: ATTNLAB_NATIVE=0"):
        native.gemv(torch.randn(1, 4), torch.randn(2, 4))


def test_a_library_that_does_not_load_is_reported(monkeypatch, fresh) -> None:
    library = native.library_file()
    library.parent.mkdir(parents=True)
    library.write_bytes(b"not a shared library")
    assert not native.available()
    reason = native.unavailable_reason()
    assert reason.startswith(f"cannot load {library}") and "run `attnlab build`" in reason


def test_a_build_is_kept_per_cpu_model_and_torch_version(monkeypatch) -> None:
    """-march=native code must never be loaded on another CPU: the build folder's name
    changes with the CPU model and the torch version (as it does with the sources)."""
    folders = {native.library_file().parent}
    monkeypatch.setattr(cache, "cpu_model", lambda: "another CPU")
    folders.add(native.library_file().parent)
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    folders.add(native.library_file().parent)
    assert len(folders) == 3
    assert all(f.parent == cache.cache_file().parent / "native" for f in folders)


def test_the_build_target_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ATTNLAB_NATIVE_MARCH`` replaces ``-march=native`` and nothing else; a value that is
    not a target name is refused by the variable's name."""
    monkeypatch.delenv("ATTNLAB_NATIVE_MARCH", raising=False)
    assert native.build_flags() == native._FLAGS and "-march=native" in native._FLAGS
    monkeypatch.setenv("ATTNLAB_NATIVE_MARCH", "x86-64-v3")
    flags = native.build_flags()
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    assert len(flags) == len(native._FLAGS)
    monkeypatch.setenv("ATTNLAB_NATIVE_MARCH", "native -fplugin=evil.so")
    with pytest.raises(ValueError, match="ATTNLAB_NATIVE_MARCH: expected a -march target"):
        native.build_flags()


def test_ninja_comes_from_its_package_when_not_on_the_path() -> None:
    """torch builds extensions with ninja; the ``ninja`` dependency ships one beside Python."""
    folder = native._ninja_folder()
    assert shutil.which("ninja", path=folder) is not None
