"""Checks of tutorial 9's exercises (``attnlab exercises check 9``)."""

import torch

from attnlab.attention import scaled_dot_product_attention
from attnlab.attention.linformer import linformer_attention, mean_pooling_projection
from attnlab.exercises.checks import assert_close, assert_equal, learner
from attnlab.masks import causal_mask, sliding_window_mask


def chapter():
    return learner(__file__)


def test_9_1_window_with_sinks():
    for L, w, g in [(12, 4, 2), (9, 3, 0), (6, 6, 1)]:
        first = torch.zeros(L, L, dtype=torch.bool)
        first[:, :g] = True
        expected = (sliding_window_mask(L, L, w, causal=True) | first) & causal_mask(L, L)
        assert_equal(chapter().window_with_sinks(L, w, g), expected,
                     name=f"window_with_sinks(L={L}, w={w}, g={g})")


def test_9_2_online_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(5, 8), torch.randn(20, 8) * 4, torch.randn(20, 3)
    full = torch.softmax(q @ k.T / 8**0.5, dim=-1) @ v
    for block, reverse in ((4, False), (4, True), (1, False), (7, True), (20, False)):
        assert_close(chapter().online_attention(q, k, v, block, reverse), full, atol=1e-5,
                     name=f"online_attention(block={block}, reverse={reverse})")


def test_9_3_math_limit():
    assert_equal(chapter().math_limit(32, 2, 16 * 2**30), 32768,
                 name="math_limit(32 heads, bfloat16, 16 GiB)")
    for heads, bytes_per, budget in [(1, 4, 1000), (8, 2, 2**20), (16, 4, 2**30)]:
        L = chapter().math_limit(heads, bytes_per, budget)
        ok = (L & (L - 1) == 0 and heads * L * L * bytes_per > budget
              and heads * (L // 2) ** 2 * bytes_per <= budget)
        assert ok, f"math_limit({heads}, {bytes_per}, {budget}) = {L}: not the first power of 2"


def test_9_4_first_output_shift():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 32, 8) for _ in range(3))
    pool = mean_pooling_projection(8, 32)

    def causal(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True)

    def linformer(q, k, v):
        return linformer_attention(q, k, v, pool, pool)

    assert_equal(chapter().first_output_shift(causal, q, k, v), 0.0,
                 name="first_output_shift of causal attention (exactly 0)")
    k2 = k.clone()
    k2[..., -1, :] += 1.0
    expected = (linformer(q, k, v) - linformer(q, k2, v))[..., 0, :].abs().max()
    assert_close(torch.tensor(chapter().first_output_shift(linformer, q, k, v)), expected,
                 name="first_output_shift of Linformer attention")
