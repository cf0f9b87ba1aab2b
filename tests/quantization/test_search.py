"""The int4 search never increases a group's squared error against round-to-nearest, and
lowers it where an outlier stretches the step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.quantization.formats import quantize


def group_errors(weight, fit, group_size, scale_dtype):
    q = quantize(weight, 4, group_size, scale_dtype, fit=fit)
    error = (q.dequantize(torch.float32) - weight) ** 2
    return error.view(weight.shape[0], -1, group_size).sum(-1)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), group_size=st.sampled_from([32, 64, 128]),
       outliers=st.sampled_from([0.0, 0.02, 0.2]), spread=st.floats(1e-4, 1e2),
       scale_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_the_search_never_increases_a_groups_squared_error(seed, group_size, outliers, spread,
                                                          scale_dtype):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(8, 256, generator=g) * spread
    mask = torch.rand(8, 256, generator=g) < outliers
    weight = torch.where(mask, weight * 6, weight)
    weight[0, :group_size] = spread  # a constant group
    searched = group_errors(weight, "search", group_size, scale_dtype)
    nearest = group_errors(weight, "nearest", group_size, scale_dtype)
    assert (searched <= nearest).all(), (searched - nearest).max()


def test_the_search_lowers_the_error_of_gaussian_weights():
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    searched = group_errors(weight, "search", 64, torch.float32).sum()
    nearest = group_errors(weight, "nearest", 64, torch.float32).sum()
    assert searched < 0.85 * nearest


def test_an_unknown_fit_is_refused_by_name():
    with pytest.raises(ValueError, match="fit: expected one of nearest, search, got 'best'"):
        quantize(torch.randn(4, 64), 4, 32, fit="best")
