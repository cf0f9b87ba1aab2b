"""Shared test helpers: an oracle comparison with a per-dtype tolerance table, the
inference kernels pinned to the formula (results independent of a calibration on a busy
machine; the kernels' own tests unpin them and prove each equal to the formula), the native
kernels that ``attnlab build`` compiled before the session (never compiled here), one thread
for the commands that tests run, and one tiny Qwen2 checkpoint folder for the tests that only
read one."""

from __future__ import annotations

import itertools
import os
import pathlib
import shutil
import threading

import pytest
import torch

from attnlab.kernels import native


@pytest.fixture(autouse=True, scope="session")
def _kernels_pinned_to_the_formula(tmp_path_factory: pytest.TempPathFactory):
    """``ATTNLAB_KERNELS=formula`` (float and quantized modules alike) and a kernel cache in a
    temporary folder for the session (subprocesses inherit them), never the user's
    ``~/.cache``. The native kernels are loaded first, from the build that ``attnlab build``
    made in the user's cache (``make test`` runs it), once for the session (tests that change
    ``$ATTNLAB_CACHE_DIR`` keep them), and their library is copied into the session's cache
    for the subprocesses; without that build they are not available."""
    native.available()
    built = native.library_file()
    patch = pytest.MonkeyPatch()
    patch.setenv("ATTNLAB_KERNELS", "formula")
    patch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
    if built.is_file():
        native.library_file().parent.mkdir(parents=True)
        shutil.copyfile(built, native.library_file())
    yield
    patch.undo()


@pytest.fixture
def native_kernels() -> None:
    """Skips a test that forces the native kernels when the session has none: they are
    compiled by ``attnlab build`` (``make test`` runs it first), never by the tests."""
    if not native.available():
        pytest.skip(native_lacks())


# The native loops that only some CPUs run: the flag /proc/cpuinfo lists, the feature's name.
_NATIVE_LOOPS = {
    "pairs": (native.pairs_available, "avx512_bf16", "AVX512-BF16 (bfloat16 pair products)"),
    "integers": (native.integers_available, "avx512_vnni",
                 "AVX512-VNNI (exact integer products)"),
    "tiles": (native.tiles_available, "amx_bf16", "AMX-BF16 (matrix tiles)"),
}


def native_lacks(loop: str | None = None) -> str | None:
    """Why the native kernels (``loop``: None for the build itself, or ``"pairs"``,
    ``"integers"``, ``"tiles"`` for its CPU-specific loops) cannot run here, in the words of
    a skip; None when they can. Asked at collection too, so that a test is parametrized only
    over what this machine runs: the library is loaded once per process, as the session
    fixture loads it."""
    if not native.available():
        reason = native.unavailable_reason()
        return ("native kernels not built (run `attnlab build`)" if reason.startswith(
            "not built") else f"native kernels not available: {reason}")
    if loop is None:
        return None
    has_loop, flag, feature = _NATIVE_LOOPS[loop]
    if has_loop():
        return None
    flags = _cpu_flags()
    if flags is not None and flag not in flags:
        return f"this CPU has no {feature}"
    march = next(f for f in native.build_flags() if f.startswith("-march="))
    if march != "-march=native":
        return f"the native build targets {march} ($ATTNLAB_NATIVE_MARCH), without {feature}"
    if loop == "tiles" and flags is not None:
        return "this CPU has AMX-BF16 but the operating system lends this process no tiles"
    return f"the native build has no {feature} loop"


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (None where there is none to read)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return None
    line = next((x for x in text.splitlines() if x.startswith("flags")), None)
    return None if line is None else set(line.split(":", 1)[1].split())


def parametrize_where(missing: str | None, argnames: str, *axes: list) -> pytest.MarkDecorator:
    """``pytest.mark.parametrize(argnames, ...)`` over every combination of ``axes`` (a tuple
    in an axis fills several names) where ``missing`` is None; else ONE case, skipped saying
    ``missing``: a machine without a kernel gets one line that says why, not one per
    combination that cannot apply to it."""
    cases = [tuple(v for part in combo for v in (part if isinstance(part, tuple) else (part,)))
             for combo in itertools.product(*axes)]
    if missing is not None:
        cases = [pytest.param(*cases[0], marks=pytest.mark.skip(reason=missing))]
    elif len(cases[0]) == 1:  # one name: pytest takes each value as it is, not in a tuple
        cases = [value for (value,) in cases]
    return pytest.mark.parametrize(argnames, cases, ids=str)


@pytest.fixture(autouse=True, scope="session")
def _one_thread_unless_told():
    """``ATTNLAB_NUM_THREADS=1`` and ``OMP_NUM_THREADS=1`` for the session where they are not
    set (``make test`` sets both): the ``attnlab`` commands that tests run, in this process
    (``main`` applies ``--threads``' default) or in subprocesses, run one thread, as torch
    does in this process under ``make test``."""
    patch = pytest.MonkeyPatch()
    for name in ("ATTNLAB_NUM_THREADS", "OMP_NUM_THREADS"):
        if not os.environ.get(name):
            patch.setenv(name, "1")
    yield
    patch.undo()


@pytest.fixture(scope="session")
def qwen2_folder(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Qwen2 folder with a BPE tokenizer and a chat template
    (``tiny_folders.make_folder``), written once per session: read it, never write."""
    from tiny_folders import make_folder

    path = tmp_path_factory.mktemp("qwen2-folder")
    make_folder(path)
    return path


# DESIGN.md: float32 rtol 1e-5 / atol 1e-6; half precisions looser.
TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    what: str = "",
) -> None:
    """``torch.testing.assert_close`` with our per-dtype defaults; on failure it names the
    worst mismatching elements (index, actual, expected)."""
    default_rtol, default_atol = TOLERANCES[expected.dtype]
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as error:
        diff = (
            (actual.detach().double() - expected.detach().double()).abs().nan_to_num(float("inf"))
        )
        worst = diff.flatten().topk(min(5, diff.numel())).indices
        lines = [
            f"  at {tuple(int(i) for i in torch.unravel_index(idx, diff.shape))}: "
            f"actual {actual.flatten()[idx].item():.8g}, "
            f"expected {expected.flatten()[idx].item():.8g}"
            for idx in worst
        ]
        raise AssertionError(f"{what}\n{error}\nworst elements:\n" + "\n".join(lines)) from None


@pytest.fixture
def one_thread():
    """One torch thread for a test's duration: quick benchmark runs are tiny, and on a busy
    machine one thread is faster than two that wait (bench generate --quick: 4 s, not 15 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def backend_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the attention backends' calls (one per attention layer call): ``{"math": n,
    "fused": n, "flash": n, "native": n}``, the first three through
    ``scaled_dot_product_attention``, ``native`` the C++ decoding kernel that
    ``FastSelfAttention`` runs for a few queries."""
    from attnlab.attention import sdpa
    from attnlab.kernels import fast_modules

    calls = dict.fromkeys(("math", "fused", "flash", "native"), 0)
    for kind in calls:
        owner = fast_modules if kind == "native" else sdpa
        real = getattr(owner, f"{kind}_attention")

        def counted(*args, _real=real, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, f"{kind}_attention", counted)
    return calls


def pause_until_abort(engine_thread, monkeypatch: pytest.MonkeyPatch, after_tokens: int,
                      hang_s: float = 600.0) -> tuple[list[str], threading.Event]:
    """A server's engine (``engine_thread.engine``) pausing before each step once it has made
    ``after_tokens`` more tokens, until the server asks ``engine_thread`` to abort a request
    (the abort itself runs on the engine's thread, between steps): a request then outlasts
    the time its client's leaving takes to be seen, however fast the machine (an event, not a
    time). Returns the ids the server asks to abort, as they come, and the event set by the
    first such request; ``hang_s`` is the pause's hang guard."""
    engine = engine_thread.engine
    start = engine.stats()["tokens_generated"]
    real_step, real_abort = engine.step, engine_thread.abort
    asked, aborted = [], threading.Event()

    def paused():
        if engine.stats()["tokens_generated"] - start >= after_tokens:
            aborted.wait(hang_s)
        return real_step()

    def spy(request_id: str) -> None:
        asked.append(request_id)
        real_abort(request_id)
        aborted.set()

    monkeypatch.setattr(engine, "step", paused)
    monkeypatch.setattr(engine_thread, "abort", spy)
    return asked, aborted
