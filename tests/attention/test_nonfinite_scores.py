"""Non-finite scores give one answer in every backend (``scaled_dot_product_attention``'s
docstring): a NaN or ``+inf`` score at a key the query may attend to (a NaN query row, a NaN
key, ``q . k`` overflowing float32) makes that query's output NaN; a ``-inf`` score (masked, or
``q . k`` overflowing below) is a weight of 0. PyTorch's fused kernel returned zeros for a NaN
query row and finite values for overflowing scores, so a NaN weight became plausible text.

The inputs here overflow by far (products near 1e50 against float32's 3.4e38), so that the
order each kernel computes in cannot decide whether a score overflows.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.attention.sdpa import scaled_dot_product_attention
from attnlab.kernels import native
from attnlab.kernels.decode_attention import native_attention

BACKENDS = ("math", "flash", "fused", "auto")
HUGE = 1e25  # a huge query row against a huge key: |q . k| ~ 1e50 overflows float32


def attend(backend: str, q, k, v, **kwargs) -> torch.Tensor:
    if backend == "native":
        return native_attention(q, k, v, kwargs.get("mask"), is_causal=kwargs.get(
            "is_causal", False))
    return scaled_dot_product_attention(q, k, v, backend=backend, **kwargs)


def assert_same_as_math(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan), (
        f"{what}: NaN at {out.isnan().nonzero().tolist()[:6]}, the formula at "
        f"{nan.nonzero().tolist()[:6]}")
    torch.testing.assert_close(out[~nan], expected[~nan], rtol=1e-4, atol=1e-5)


def inputs(L: int = 3, S: int = 7, D: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, L, D, generator=g), torch.randn(2, 2, S, D, generator=g),
            torch.randn(2, 2, S, D, generator=g))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_a_nan_query_row_gives_a_nan_row_and_leaves_the_others(backend, is_causal) -> None:
    q, k, v = inputs()
    q[0, 1, 1, 3] = float("nan")  # one query row of one head (a NaN row of q_proj gives this)
    out = attend(backend, q, k, v, is_causal=is_causal)
    assert bool(out[0, 1, 1].isnan().all()), f"{backend}: {out[0, 1, 1].tolist()}"
    clean = torch.ones_like(out, dtype=torch.bool)
    clean[0, 1, 1] = False
    assert not bool(out[clean].isnan().any())
    assert_same_as_math(out, attend("math", q, k, v, is_causal=is_causal), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_infinite_inputs_agree_with_the_formula(backend) -> None:
    q, k, v = inputs()
    cases = {"inf in a query": (0, float("inf"), None), "nan key": (1, float("nan"), None),
             "nan value": (2, float("nan"), None), "masked nan key": (1, float("nan"), 0)}
    for what, (which, bad, masked) in cases.items():
        tensors = [t.clone() for t in (q, k, v)]
        tensors[which][1, 0, 2, 5] = bad
        mask = None
        if masked is not None:  # key 2 is masked for every query: its NaN must not count
            mask = torch.ones(7, dtype=torch.bool)
            mask[2] = False
        out = attend(backend, *tensors, mask=mask)
        assert_same_as_math(out, attend("math", *tensors, mask=mask), f"{backend}, {what}")
        assert not bool(out[0].isnan().any()), f"{backend}, {what}: spread to another row"
    assert not bool(out.isnan().any())  # the masked NaN key counted nowhere


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_overflowing_scores_give_nan_above_and_zero_weight_below(backend, is_causal) -> None:
    q, k, v = inputs(L=4, S=6)
    q[:, :, 1] = q[:, :, 1].abs() * HUGE  # row 1 meets key 0 at +inf ...
    q[:, :, 2] = q[:, :, 2].abs() * HUGE  # ... row 2 meets key 0 at -inf only
    k[:, :, 0] = k[:, :, 0].abs() * HUGE  # every product of rows 1 and 2 with key 0 one sign
    q[:, :, 2] = -q[:, :, 2]
    out = attend(backend, q, k, v, is_causal=is_causal)
    expected = attend("math", q, k, v, is_causal=is_causal)
    assert bool(expected[:, :, 1].isnan().all())  # +inf at an attended key: NaN
    assert not bool(expected[:, :, 2].isnan().any())  # -inf: weight 0, the rest attended
    assert_same_as_math(out, expected, backend)


@pytest.mark.parametrize("seed", range(4))
def test_random_overflowing_inputs_agree_in_every_backend(seed) -> None:
    """Queries and keys, some scaled by 1e25, over one and several of flash's key tiles."""
    g = torch.Generator().manual_seed(seed)
    for trial in range(12):
        L, S, D = 1 + trial % 4, (5, 40, 300)[trial % 3], (4, 16, 64)[trial % 3]
        q, k, v = (torch.randn(1, 2, n, D, generator=g) for n in (L, S, S))
        q = torch.where(torch.rand(1, 2, L, 1, generator=g) < 0.4, q * HUGE, q)
        k = torch.where(torch.rand(1, 2, S, 1, generator=g) < 0.1, k * HUGE, k)
        if trial % 2:  # one sign: +inf rather than NaN sums
            q, k = q.abs(), k.abs()
        expected = attend("math", q, k, v, is_causal=True)
        for backend in BACKENDS[1:]:
            out = attend(backend, q, k, v, is_causal=True)
            assert_same_as_math(out, expected, f"{backend}, trial {trial} ({L}, {S}, {D})")


def test_the_native_decode_kernel_follows_the_same_rule() -> None:
    if not native.available():
        pytest.skip("the native kernels are not built (attnlab build)")
    q, k, v = inputs(L=2, S=40)  # past one vector of keys: the kernel's exp in lanes
    q[0, 1, 0, 3] = float("nan")
    q[1, :, 1] = q[1, :, 1].abs() * HUGE
    k[1, :, 0] = k[1, :, 0].abs() * HUGE  # batch row 1, query 1: +inf at key 0
    k[1, :, 4] = -k[1, :, 4].abs() * HUGE  # and -inf at key 4
    for is_causal in (False, True):
        out = attend("native", q, k, v, is_causal=is_causal)
        expected = attend("math", q, k, v, is_causal=is_causal)
        assert bool(expected[1, :, 1].isnan().all()) and bool(expected[0, 1, 0].isnan().all())
        assert_same_as_math(out, expected, f"native, is_causal={is_causal}")
