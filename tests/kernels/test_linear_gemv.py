"""The GEMV kernels (formerly ``functional.linear``'s CPU fast paths): one row as an
embedding_bag product or as per-thread blocks, several rows as one embedding_bag per row or
through oneDNN on a column-major weight, each against the plain product."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import (
    column_major,
    own_cache_fixture,  # noqa: F401 (an autouse fixture)
    thread_count,
)

from attnlab.functional import linear
from attnlab.kernels import KERNELS
from attnlab.kernels.calibration import weight_like


def run(name: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Kernel ``name`` on ``x`` (``M x I``) and ``w`` prepared by it, under no_grad."""
    kernel = KERNELS[name]
    if not kernel.available(w, w.dtype, x.shape[0]):
        pytest.skip(f"{name} cannot run {w.dtype} here")
    with torch.no_grad():
        return kernel.run(x, kernel.prepare(w, w.dtype), b)


@pytest.mark.parametrize("name", ["columns", "onednn_columns", "rows_gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_column_major_one_row_matches_matmul(name, dtype, threads) -> None:
    with thread_count(threads):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(300, 70, generator=g).to(dtype)
        x, b = torch.randn(1, 70, generator=g).to(dtype), torch.randn(300).to(dtype)
        assert KERNELS[name].prepare(w, w.dtype).t().is_contiguous()  # the column-major layout
        expected = (x.double() @ w.double().t() + b.double()).to(dtype)
        actual = run(name, x, w, b)
        assert actual.shape == (1, 300) and actual.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(run(name, x, w, None), linear(x, w), rtol=tol, atol=tol)


def test_gradients_still_flow_through_column_major_weights() -> None:
    w = torch.randn(5, 4).t().contiguous().t().requires_grad_()
    x = torch.randn(1, 4, requires_grad=True)
    linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.detach().expand(5, 4))


@pytest.mark.parametrize("name", ["columns", "onednn_columns", "rows_gemv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 40])
def test_column_major_several_rows_match_matmul(name, dtype, rows) -> None:
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(300, 70, generator=g).to(dtype), torch.randn(300).to(dtype)
    x = torch.randn(rows, 70, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(run(name, x, w, b), linear(x, w, b), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "threads"), [(1, 2), (2, 1), (2, 4), (3, 2), (7, 2)])
def test_embedding_bag_product_of_several_rows(dtype, rows, threads) -> None:
    """The embedding_bag product, rows fewer and more than threads, each row cut into
    per-thread bags or not."""
    with thread_count(threads):
        g = torch.Generator().manual_seed(2)
        w = torch.randn(300, 200, generator=g).to(dtype)
        x, b = torch.randn(rows, 200, generator=g).to(dtype), torch.randn(300).to(dtype)
        expected = x.double() @ w.double().t() + b.double()
        actual = run("rows_gemv", x, column_major(w), b)
        assert actual.shape == (rows, 300) and actual.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol)
        # One row after several: the cached single-row index serves it.
        torch.testing.assert_close(run("rows_gemv", x[:1], column_major(w), b).double(),
                                   expected[:1], rtol=tol, atol=tol)


@pytest.mark.parametrize(("out_features", "splits"), [(2048, True), (2047, False)])
def test_one_row_times_a_large_row_major_matrix(out_features, splits) -> None:
    """The per-thread blocks product equals the plain product; it applies only when the
    outputs split evenly over the threads, and only to one row."""
    with thread_count(2):
        g = torch.Generator().manual_seed(3)
        w = torch.randn(out_features, 512, generator=g)
        x, b = torch.randn(1, 512, generator=g), torch.randn(out_features, generator=g)
        blocks = KERNELS["blocks_gemv"]
        like = weight_like(torch.float32, out_features, 8)
        assert blocks.available(like, torch.float32, 1) is splits
        assert not blocks.available(like, torch.float32, 2)
        if splits:
            expected = x.double() @ w.double().t() + b.double()
            torch.testing.assert_close(run("blocks_gemv", x, w, b).double(), expected,
                                       rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(run("blocks_gemv", x, w, None).double(),
                                       expected - b.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [2, 4])
def test_column_blocks_product_of_one_row(threads) -> None:
    """One row times a column-major weight as per-thread blocks: either layout works."""
    with thread_count(threads):
        g = torch.Generator().manual_seed(4)
        w, b = torch.randn(2048, 512, generator=g), torch.randn(2048, generator=g)
        x = torch.randn(1, 512, generator=g)
        expected = x.double() @ w.double().t()
        with torch.no_grad():
            columns = column_major(w)
            blocks = KERNELS["blocks_gemv"].run
            torch.testing.assert_close(blocks(x, columns, None).double(), expected,
                                       rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(blocks(x, columns, b).double(), expected + b.double(),
                                       rtol=1e-5, atol=1e-4)
