"""Checks of tutorial 4's exercises (``attnlab exercises check 4``)."""

import math

import torch

from attnlab.attention import scaled_dot_product_attention
from attnlab.exercises.checks import assert_close, assert_equal, learner
from attnlab.layers import RoPE, RopeScaling, SinusoidalPositionalEncoding, rope_inverse_frequencies


def chapter():
    return learner(__file__)


def test_4_1_shift_matrix():
    for E, k in [(64, 5), (16, 1), (32, 12)]:
        table = SinusoidalPositionalEncoding(E, max_len=128).pe.double()
        M = chapter().shift_matrix(k, E)
        assert_close(table[:-k] @ M.T, table[k:], atol=1e-5,
                     name=f"PE[p] M_k^T against PE[p + k], E={E}, k={k}")


def test_4_2_uniform_causal_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    zeros = torch.zeros(2, 6, 16)
    assert_close(chapter().uniform_causal_attention(x),
                 scaled_dot_product_attention(zeros, zeros, x, is_causal=True), atol=1e-6,
                 name="uniform_causal_attention(x) against attention with q = k = 0")
    marker = torch.zeros(1, 6, 4)
    marker[0, 0, 0] = 1.0
    assert_close(chapter().uniform_causal_attention(marker)[0, :, 0],
                 1 / torch.arange(1.0, 7.0), name="a marker at position 0 reads 1 / (i + 1)")


def test_4_3_complex_rope():
    torch.manual_seed(0)
    for D, base in [(16, 10000.0), (8, 500.0)]:
        x = torch.randn(2, 7, 3, D)
        reference = RoPE(D, max_len=64, base=base, traditional=True)(x)
        assert_close(chapter().complex_rope(x, base), reference, atol=1e-5,
                     name=f"complex_rope(x, base={base:g}) against RoPE(traditional=True), D={D}")


def test_4_4_pairs_under_one_turn():
    for head_dim, base, context in [(64, 1e6, 32768), (128, 5e5, 8192), (64, 1e4, 2048)]:
        inv_freq, _ = rope_inverse_frequencies(head_dim, base, RopeScaling(), context)
        expected = int((context * inv_freq.double() / (2 * math.pi) < 1).sum())
        assert_equal(chapter().pairs_under_one_turn(head_dim, base, context), expected,
                     name=f"pairs_under_one_turn({head_dim}, {base:g}, {context})")
