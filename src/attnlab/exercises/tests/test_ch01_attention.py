"""Checks of tutorial 1's exercises (``attnlab exercises check 1``)."""

import math

import torch

from attnlab.attention import scaled_dot_product_attention
from attnlab.exercises.checks import assert_close, assert_equal, learner


def chapter():
    return learner(__file__)


def test_1_1_scaled_score_variance():
    for sigma, expected in [(1.0, 1.0), (2.0, 16.0)]:
        for d in [8, 128, 1024]:
            var = float(chapter().scaled_score_variance(
                d, sigma, 8000, generator=torch.Generator().manual_seed(0)))
            assert abs(var / expected - 1) < 0.15, (
                f"scaled_score_variance(d={d}, sigma={sigma}) = {var:.3g}, expected about "
                f"{expected:g} (sigma**4): divide the dot products by sqrt(d), not d")
    once, again = (chapter().scaled_score_variance(16, 1.0, 100,
                                                   generator=torch.Generator().manual_seed(1))
                   for _ in range(2))
    assert once == again, "draw q and k with the generator passed in (same seed, same value)"


def test_1_2_my_attention_matches_the_library():
    torch.manual_seed(0)
    shapes = [((4, 8), (4, 8)), ((2, 3, 4, 8), (2, 3, 6, 8)), ((3, 1, 8), (3, 5, 8))]
    for shape_q, shape_kv in shapes:
        q = torch.randn(shape_q, requires_grad=True)
        k = torch.randn(shape_kv, requires_grad=True)
        v = torch.randn(*shape_kv[:-1], 5, requires_grad=True)
        expected = scaled_dot_product_attention(q, k, v, backend="math")
        mine = chapter().my_attention(q, k, v)
        assert_close(mine, expected, name=f"my_attention, q {shape_q}, k {shape_kv}")
        grads = torch.autograd.grad(mine.sum(), (q, k, v))
        ref_grads = torch.autograd.grad(expected.sum(), (q, k, v))
        for n, (g, ref) in enumerate(zip(grads, ref_grads)):
            assert_close(g, ref, name=f"the gradient of {'qkv'[n]}", atol=1e-5)


def test_1_2_my_attention_with_a_mask():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 4, 8) for _ in range(3))
    allowed = torch.rand(4, 4) > 0.5
    allowed[:, 0] = True
    assert_close(chapter().my_attention(q, k, v, allowed),
                 scaled_dot_product_attention(q, k, v, allowed, backend="math"),
                 name="my_attention with a 4 x 4 mask (True = may attend)")
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert_close(chapter().my_attention(q, k, v, causal),
                 scaled_dot_product_attention(q, k, v, is_causal=True, backend="math"),
                 name="my_attention with the causal mask")


def test_1_3_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [3.0, 3.0, 1.0, 0.0, 0.0]])
    for t in [0.01, 0.5, 1.0, 100.0]:
        assert_close(chapter().tempered_softmax(logits, t), torch.softmax(logits / t, dim=-1),
                     name=f"tempered_softmax(x, T={t})")
    assert_close(chapter().tempered_softmax(logits[1], 0.01),
                 torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0]),
                 name="T -> 0 with a tie: the tied maxima share the weight")
    huge = torch.tensor([1000.0, 0.0])
    assert_close(chapter().tempered_softmax(huge, 0.01), torch.tensor([1.0, 0.0]),
                 name="tempered_softmax([1000, 0], T=0.01) (subtract the maximum: no NaN)")


def test_1_4_first_overflow():
    assert_equal(chapter().first_overflow(torch.float32), 89, name="first_overflow(float32)")
    assert_equal(chapter().first_overflow(torch.float16), 12, name="first_overflow(float16)")


def test_1_4_stable_softmax():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7) * 5
    assert_close(chapter().stable_softmax(x), torch.softmax(x, dim=-1), name="stable_softmax(x)")
    for dtype, first in [(torch.float32, 89.0), (torch.float16, 12.0)]:
        big = torch.tensor([first, first - 1, 0.0], dtype=dtype)
        atol = 1e-6 if dtype == torch.float32 else 1e-3
        assert_close(chapter().stable_softmax(big), torch.softmax(big.float(), -1).to(dtype),
                     name=f"stable_softmax([{first:g}, {first - 1:g}, 0]) in {dtype}", atol=atol)


def test_1_5_identical_keys_output():
    torch.manual_seed(0)
    values = torch.randn(2, 6, 3)
    keys = torch.randn(2, 1, 8).expand(2, 6, 8)
    out = scaled_dot_product_attention(torch.randn(2, 4, 8) * math.pi, keys, values)
    mine = chapter().identical_keys_output(values)
    assert_close(mine, out[:, 0], name="identical_keys_output(values)")
    assert_close(out, mine[:, None].expand_as(out),
                 name="the output of every query (it does not depend on the query)")


def test_1_6_max_path_length():
    for L in (2, 10, 1024):
        assert_equal(chapter().max_path_length(L, "recurrent"), L - 1,
                     name=f"max_path_length({L}, 'recurrent')")
        assert_equal(chapter().max_path_length(L, "self-attention"), 1,
                     name=f"max_path_length({L}, 'self-attention')")
    # Stack causal convolutions of width 3 until the last output depends on the first input.
    for L, kernel in [(10, 3), (100, 5), (2, 2)]:
        reach, layers = torch.eye(L, dtype=torch.bool), 0
        band = (torch.ones(L, L).tril() - torch.ones(L, L).tril(-kernel)).bool()
        while not reach[-1, 0]:
            reach, layers = (band.float() @ reach.float()) > 0, layers + 1
        assert_equal(chapter().max_path_length(L, "convolution", kernel), layers,
                     name=f"max_path_length({L}, 'convolution', kernel={kernel})")
