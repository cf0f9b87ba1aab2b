"""Shared test helpers: an oracle comparison with a per-dtype tolerance table, the
inference kernels pinned to the formula (results independent of a calibration on a busy
machine; the kernels' own tests unpin them and prove each equal to the formula), and one
tiny Qwen2 checkpoint folder for the tests that only read one."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _kernels_pinned_to_the_formula(tmp_path_factory: pytest.TempPathFactory):
    """``ATTNLAB_KERNELS=formula`` (float and quantized modules alike) and a kernel cache in a
    temporary folder for the session (subprocesses inherit them), never the user's
    ``~/.cache``."""
    patch = pytest.MonkeyPatch()
    patch.setenv("ATTNLAB_KERNELS", "formula")
    patch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))
    yield
    patch.undo()


@pytest.fixture(scope="session")
def qwen2_folder(tmp_path_factory: pytest.TempPathFactory):
    """A tiny random Qwen2 folder with a BPE tokenizer and a chat template
    (``test_cli_generate.make_folder``), written once per session: read it, never write."""
    from test_cli_generate import make_folder

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
def auto_backend():
    """``auto_backend(queries)``: what ``backend="auto"`` runs for that many queries on the
    CPU with no gradient and no scores/pattern hook (``backend_calls``'s names): the C++
    decoding kernel for a few, where it is built, else torch's fused kernel."""
    from attnlab.kernels import native

    return lambda queries: ("native" if queries <= native.MAX_ROWS and native.available()
                            else "fused")


@pytest.fixture
def backend_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the attention backends' calls through ``scaled_dot_product_attention``
    (one per attention layer call): ``{"math": n, "fused": n, "flash": n, "native": n}``,
    ``native`` the C++ decoding kernel that ``auto`` runs for a few queries."""
    from attnlab.attention import sdpa

    calls = dict.fromkeys(("math", "fused", "flash", "native"), 0)
    for kind in calls:
        real = getattr(sdpa, f"{kind}_attention")

        def counted(*args, _real=real, _kind=kind, **kwargs):
            calls[_kind] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(sdpa, f"{kind}_attention", counted)
    return calls
