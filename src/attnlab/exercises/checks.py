"""What the exercises' tests use: the learner's module, and comparisons whose failures say what
is wrong (the shape, the dtype, how many elements differ and the first of them).

The tests are plain functions with ``assert``: ``attnlab exercises check`` runs them without
pytest, and ``pytest exercises/`` runs them too.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

# The folder of the modules under test; `attnlab exercises check --dir` sets it. Without it a
# test file checks the modules one folder above its own (exercises/tests/ -> exercises/).
DIR_VARIABLE = "ATTNLAB_EXERCISES_DIR"

_loaded: dict[tuple[Path, int], ModuleType] = {}


def learner(test_file: str) -> ModuleType:
    """The module that ``test_file`` (``.../tests/test_NAME.py``) checks: ``NAME.py`` of the
    folder named by ``$ATTNLAB_EXERCISES_DIR``, else of the folder above ``tests/``. Loaded
    again when the file changed, so that a learner's edit is seen."""
    test_path = Path(test_file).resolve()
    chapter = test_path.stem.removeprefix("test_")
    folder = Path(os.environ.get(DIR_VARIABLE) or test_path.parents[1])
    path = folder / f"{chapter}.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"no {path.name} in {folder}: run `attnlab exercises init DIR` first, and check "
            f"with --dir DIR (the folder that holds exercises/)"
        )
    key = (path, path.stat().st_mtime_ns)
    if key not in _loaded:
        spec = importlib.util.spec_from_file_location(f"_attnlab_exercise_{chapter}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded[key] = module
    return _loaded[key]


def assert_close(actual: object, expected: Tensor, *, name: str = "the result",
                 rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Fail unless ``actual`` is a tensor of ``expected``'s shape and dtype whose elements are
    within ``atol + rtol * |expected|`` of it (NaN equal to NaN); the message gives the first
    differing element, the count of differing elements and the largest difference."""
    if not isinstance(actual, Tensor):
        raise AssertionError(f"{name}: expected a torch.Tensor, got {type(actual).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype}, expected {expected.dtype}")
    got, want = actual.detach().double(), expected.detach().double()
    close = torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if bool(close.all()):
        return
    wrong = (~close).nonzero()
    first = tuple(wrong[0].tolist())
    worst = (got - want).abs().nan_to_num(nan=float("inf"))[~close].max().item()
    raise AssertionError(
        f"{name}: {len(wrong)} of {close.numel()} elements differ (largest difference "
        f"{worst:.3g}, tolerance atol={atol:g} rtol={rtol:g}); the first differing element "
        f"is at index {first}: got {got[first].item():.6g}, expected {want[first].item():.6g}"
    )


def assert_equal(actual: object, expected: object, *, name: str = "the result") -> None:
    """Fail unless ``actual == expected`` (tensors: the same shape, dtype and every element),
    with a message that gives both."""
    if isinstance(expected, Tensor):
        if not isinstance(actual, Tensor):
            raise AssertionError(f"{name}: expected a torch.Tensor, got {type(actual).__name__}")
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            raise AssertionError(
                f"{name}: shape {tuple(actual.shape)} {actual.dtype}, expected "
                f"{tuple(expected.shape)} {expected.dtype}"
            )
        differ = actual != expected
        if bool(differ.any()):
            first = tuple(differ.nonzero()[0].tolist())
            raise AssertionError(
                f"{name}: {int(differ.sum())} of {differ.numel()} elements differ; the first "
                f"at index {first}: got {actual[first].item()}, expected {expected[first].item()}"
            )
        return
    if isinstance(actual, Tensor):  # a tensor where a number or a list is expected
        actual = actual.tolist()
    if actual != expected:
        raise AssertionError(f"{name}: got {actual!r}, expected {expected!r}")
