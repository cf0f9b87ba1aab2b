"""Checks of tutorial 2's exercises (``attnlab exercises check 2``)."""

import torch

from attnlab import masks
from attnlab.attention import scaled_dot_product_attention
from attnlab.exercises.checks import assert_close, assert_equal, learner


def chapter():
    return learner(__file__)


def test_2_1_batch_causal_padding_mask():
    lengths = torch.tensor([3, 5, 1])
    key_mask = torch.arange(5)[None, :] < lengths[:, None]
    expected = (key_mask[:, None, None, :] & torch.ones(5, 5, dtype=torch.bool).tril())
    assert_equal(chapter().batch_causal_padding_mask(lengths, 5), expected,
                 name="batch_causal_padding_mask([3, 5, 1], 5), B x 1 x L x L")


def test_2_2_padded_self_attention():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for causal in (False, True):
        alone = scaled_dot_product_attention(x, x, x, is_causal=causal)
        for n_pad in (0, 2, 6):
            padding = torch.randn(n_pad, 8) * 10
            out = chapter().padded_self_attention(x, padding, causal=causal)
            assert_close(out[:4], alone, atol=1e-5,
                         name=f"the real tokens' rows, causal={causal}, {n_pad} padding tokens")
            full = torch.cat([x, padding])
            expected = scaled_dot_product_attention(
                full, full, full, torch.arange(4 + n_pad) < 4, is_causal=causal)
            assert_close(out, expected, atol=1e-5,
                         name=f"every row, padding included (causal={causal}, {n_pad} pads)")


def test_2_3_to_key_mask():
    pt = torch.tensor([[False, False, True], [False, False, False]])
    hf = torch.tensor([[1, 1, 0], [1, 1, 1]])
    expected = torch.tensor([[True, True, False], [True, True, True]])
    assert_equal(chapter().to_key_mask(pt, "pytorch"), expected,
                 name="to_key_mask(key_padding_mask, 'pytorch') (PyTorch: True = padding)")
    assert_equal(chapter().to_key_mask(hf, "hf"), expected,
                 name="to_key_mask(attention_mask, 'hf') (Hugging Face: 1 = real)")
    assert_equal(chapter().to_key_mask(pt, "pytorch"), masks.from_key_padding_mask(pt),
                 name="to_key_mask against masks.from_key_padding_mask")
    try:
        chapter().to_key_mask(hf, "keras")
    except ValueError as error:
        assert "convention" in str(error), f"the message should name convention: {error!r}"
    else:
        raise AssertionError("to_key_mask(m, 'keras') should raise ValueError")


def test_2_4_cached_step_mask():
    for cached, new in [(7, 3), (0, 4), (5, 1)]:
        assert_equal(chapter().cached_step_mask(cached, new),
                     masks.causal_mask(new, cached + new),
                     name=f"cached_step_mask({cached}, {new}) (bottom-right aligned)")
    row = chapter().cached_step_mask(7, 3)[1]
    assert_equal(row.nonzero().flatten().tolist(), list(range(9)),
                 name="the keys the second new token sees (7 cached + 3 new)")


def test_2_5_empty_rows():
    lengths = torch.tensor([2, 4, 5])
    assert_equal(chapter().empty_rows(lengths, 5, left=False), [0, 0, 0],
                 name="empty_rows with right padding")
    assert_equal(chapter().empty_rows(lengths, 5, left=True), [3, 1, 0],
                 name="empty_rows with left padding")
    assert_equal(chapter().empty_rows(torch.tensor([1, 6]), 6, left=True), [5, 0],
                 name="empty_rows([1, 6], 6, left=True)")
