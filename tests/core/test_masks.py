import pytest
import torch

from attnlab import masks


def test_causal_mask_square_is_lower_triangle():
    assert torch.equal(masks.causal_mask(5), torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize(("L", "S"), [(1, 6), (3, 7), (7, 3), (4, 4)])
def test_causal_mask_is_bottom_right_aligned(L, S):
    m = masks.causal_mask(L, S)
    assert m.shape == (L, S)
    for i in range(L):
        for j in range(S):
            assert bool(m[i, j]) == (j <= i + S - L)
    if L <= S:
        assert m[-1].all()  # the last query sees every key, as with a KV cache


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_mask_by_definition(causal):
    L, S, w = 5, 9, 3
    m = masks.sliding_window_mask(L, S, w, causal=causal)
    for i in range(L):
        p = i + S - L
        for j in range(S):
            expected = (p - w < j <= p) if causal else abs(j - p) < w
            assert bool(m[i, j]) == expected


def test_sliding_window_with_large_window_is_causal():
    assert torch.equal(masks.sliding_window_mask(6, 6, 100), masks.causal_mask(6))


def test_padding_mask_from_lengths_and_from_ids():
    from_lengths = masks.padding_mask(torch.tensor([3, 1, 0]), max_len=4)
    expected = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(from_lengths, expected)
    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 0, 0]])
    assert torch.equal(masks.padding_mask(ids, pad_id=0), expected[:2])


def test_combine_masks_is_logical_and_and_keeps_additive_biases():
    a = torch.tensor([[True, False], [True, True]])
    b = torch.tensor([[True, True], [False, True]])
    assert torch.equal(masks.combine_masks(a, None, b), a & b)
    assert masks.combine_masks(None, None) is None
    bias = torch.tensor([[0.5, -1.0], [0.0, 2.0]])
    combined = masks.combine_masks(bias, a)
    assert combined.dtype == torch.float32
    assert torch.equal(combined, bias.masked_fill(~a, float("-inf")))


def test_additive_and_bool_round_trip():
    m = torch.rand(3, 4, 5) > 0.5
    add = masks.to_additive(m, torch.float64)
    assert add.dtype == torch.float64
    assert torch.equal(add[m], torch.zeros(int(m.sum()), dtype=torch.float64))
    assert torch.isneginf(add[~m]).all()
    assert torch.equal(masks.to_bool(add), m)
    assert masks.to_bool(m) is m


def test_converters_at_the_edges():
    kpm = torch.tensor([[False, False, True]])  # PyTorch: True = ignore
    assert torch.equal(masks.from_key_padding_mask(kpm), torch.tensor([[True, True, False]]))
    hf = torch.tensor([[1, 1, 0]])  # Hugging Face: 1 = real token
    assert torch.equal(masks.from_hf_attention_mask(hf), torch.tensor([[True, True, False]]))
    assert masks.key_mask_to_attention_mask(torch.ones(2, 3, dtype=torch.bool)).shape == (
        2,
        1,
        1,
        3,
    )


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: masks.causal_mask(-1), "L"),
        (lambda: masks.sliding_window_mask(4, 4, 0), "window"),
        (lambda: masks.padding_mask(torch.tensor([2.0, 1.0])), "tokens_or_lengths"),
        (lambda: masks.padding_mask(torch.tensor([3, 1]), max_len=2), "max_len"),
        (
            lambda: masks.padding_mask(torch.ones(2, 3, 4, dtype=torch.long), pad_id=0),
            "tokens_or_lengths",
        ),
        (lambda: masks.from_hf_attention_mask(torch.ones(3)), "attention_mask"),
        (lambda: masks.causal_mask(True), "L"),
        (lambda: masks.to_bool(torch.tensor([0, 1, 2])), "mask"),
        (lambda: masks.combine_masks(torch.tensor([1, 3]), None), "mask"),
    ],
)
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()
