"""``functional.linear``'s CPU fast paths: one row as an embedding_bag GEMV or as per-thread
blocks, several rows as one embedding_bag per row (bfloat16) or through oneDNN (float32),
each against the plain product."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from attnlab.functional import linear


@contextmanager
def thread_count(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` for the block, restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def column_major(w: torch.Tensor) -> torch.Tensor:
    """The same values as ``w``, stored column-major (the inference layout)."""
    return w.t().contiguous().t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_column_major_one_row_matches_matmul(dtype, threads) -> None:
    with thread_count(threads):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(300, 70, generator=g).to(dtype)
        columns = column_major(w)  # same values, column-major
        x, b = torch.randn(1, 1, 70, generator=g).to(dtype), torch.randn(300).to(dtype)
        expected = (x.double() @ w.double().t() + b.double()).to(dtype)
        with torch.no_grad():
            actual = linear(x, columns, b)
        assert actual.shape == (1, 1, 300) and actual.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(linear(x, columns), linear(x, w), rtol=tol, atol=tol)


def test_gradients_still_flow_through_column_major_weights() -> None:
    w = torch.randn(5, 4).t().contiguous().t().requires_grad_()
    x = torch.randn(1, 4, requires_grad=True)
    linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.detach().expand(5, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 40])  # a few rows (oneDNN) and many (MKL on AVX2 CPUs)
def test_column_major_several_rows_match_matmul(dtype, rows) -> None:
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(300, 70, generator=g).to(dtype), torch.randn(300).to(dtype)
    x = torch.randn(2, rows, 70, generator=g).to(dtype)
    with torch.no_grad():
        actual = linear(x, column_major(w), b)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(actual, linear(x, w, b), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "threads"), [(1, 2), (2, 1), (2, 4), (3, 2), (7, 2)])
def test_embedding_bag_product_of_several_rows(dtype, rows, threads) -> None:
    """The embedding_bag product (bfloat16 on CPUs without a native bfloat16 GEMM), rows
    fewer and more than threads, each row cut into per-thread bags or not."""
    from attnlab.functional import _rows_gemv

    with thread_count(threads):
        g = torch.Generator().manual_seed(2)
        w = torch.randn(300, 200, generator=g).to(dtype)
        x, b = torch.randn(rows, 200, generator=g).to(dtype), torch.randn(300).to(dtype)
        expected = x.double() @ w.double().t() + b.double()
        with torch.no_grad():
            actual = _rows_gemv(x, column_major(w), b)
        assert actual.shape == (rows, 300) and actual.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol)
        # One row after several: the cached single-row index serves it.
        torch.testing.assert_close(_rows_gemv(x[:1], column_major(w), b).double(),
                                   expected[:1], rtol=tol, atol=tol)


@pytest.mark.parametrize("out_features", [2048, 2047])  # splits over 2 threads, or not
def test_one_row_times_a_large_row_major_matrix(out_features) -> None:
    """The threaded GEMV path (one block of rows per thread) equals the plain product."""
    with thread_count(2):
        g = torch.Generator().manual_seed(3)
        w = torch.randn(out_features, 512, generator=g)  # 4 MiB: large enough for the path
        x, b = torch.randn(1, 1, 512, generator=g), torch.randn(out_features, generator=g)
        expected = x.double() @ w.double().t() + b.double()
        with torch.no_grad():
            actual = linear(x, w, b)
            plain = linear(x, w)
        assert actual.shape == (1, 1, out_features)
        torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(plain.double(), expected - b.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("threads", [2, 4])
def test_column_blocks_product_of_one_row(threads) -> None:
    """One row times a column-major weight as per-thread column blocks (AVX2 CPUs)."""
    from attnlab.functional import _blocks_gemv

    with thread_count(threads):
        g = torch.Generator().manual_seed(4)
        w, b = torch.randn(2048, 512, generator=g), torch.randn(2048, generator=g)
        x = torch.randn(1, 512, generator=g)
        expected = x.double() @ w.double().t()
        with torch.no_grad():
            columns = column_major(w)
            torch.testing.assert_close(_blocks_gemv(x, columns, None).double(),
                                       expected, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(_blocks_gemv(x, columns, b).double(),
                                       expected + b.double(), rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(linear(x, columns, b).double(), expected + b.double(),
                                       rtol=1e-5, atol=1e-4)
