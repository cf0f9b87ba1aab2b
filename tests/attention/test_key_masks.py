"""One key-mask rule in every layer: a key mask is bool or 0/1 (True / 1 = may attend);
anything else is refused. Only ``mask`` of scaled_dot_product_attention / MHA is additive.
And inputs whose dtype or device differ from the module's are named in the error."""

import pytest
import torch

from attnlab.attention import MultiHeadAttention
from attnlab.attention.linformer import LinformerAttention, linformer_attention
from attnlab.attention.performer import (
    PerformerAttention,
    favor_attention,
    orthogonal_random_features,
)
from attnlab.attention.sparse import SparseAttention, sliding_window_attention
from attnlab.masks import (
    from_hf_attention_mask,
    from_key_padding_mask,
    key_mask_to_attention_mask,
    key_mask_to_bool,
)
from conftest import assert_close

KEEP = torch.tensor([[True, True, False, True, False, True],
                     [True, False, True, True, True, False]])
AMBIGUOUS = {
    "additive": torch.zeros(2, 6).masked_fill(~KEEP, float("-inf")),
    "fraction": KEEP.float() * 0.5,
    "two": KEEP.long() * 2,
}


def _layers():
    torch.manual_seed(0)
    return {
        "mha_math": MultiHeadAttention(8, 2, backend="math"),
        "mha_flash": MultiHeadAttention(8, 2, backend="flash"),
        "mha_fused": MultiHeadAttention(8, 2, backend="fused"),
        "mha_gqa_auto": MultiHeadAttention(8, 4, num_kv_heads=2),
        "sparse": SparseAttention(8, 2, window=3),
        "strided": SparseAttention(8, 2, window=2, stride=3),
        "linformer": LinformerAttention(8, 2, max_len=6, proj_len=6),
        "performer": PerformerAttention(8, 2, num_features=16),
    }


@pytest.mark.parametrize("name", list(_layers()))
def test_float_and_integer_0_1_key_masks_mean_may_attend_like_bool(name):
    layer = _layers()[name]
    x = torch.randn(2, 6, 8)
    ref = layer(x, key_mask=KEEP)
    for key_mask in (KEEP.float(), KEEP.long(), KEEP.to(torch.uint8), KEEP.double()):
        assert_close(layer(x, key_mask=key_mask), ref, what=str(key_mask.dtype))
    # and the mask does mask something
    assert not torch.allclose(layer(x, key_mask=torch.ones(2, 6, dtype=torch.bool)), ref)


@pytest.mark.parametrize("kind", list(AMBIGUOUS))
@pytest.mark.parametrize("name", list(_layers()))
def test_ambiguous_key_masks_are_refused_naming_key_mask(name, kind):
    layer = _layers()[name]
    with pytest.raises(ValueError, match="key_mask: expected bool or 0/1"):
        layer(torch.randn(2, 6, 8), key_mask=AMBIGUOUS[kind])


def test_functional_layers_follow_the_key_mask_rule():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    eye = torch.eye(6)
    features = orthogonal_random_features(8, 4, generator=g)
    calls = {
        "sliding": lambda m: sliding_window_attention(q, k, v, 3, key_mask=m),
        "linformer": lambda m: linformer_attention(q, k, v, eye, eye, key_mask=m),
        "favor": lambda m: favor_attention(q, k, v, features, key_mask=m),
    }
    for name, call in calls.items():
        assert_close(call(KEEP.float()), call(KEEP), what=name)
        with pytest.raises(ValueError, match="key_mask"):
            call(AMBIGUOUS["additive"])


def test_key_mask_to_bool_and_converters():
    assert torch.equal(key_mask_to_bool(KEEP.float()), KEEP)
    assert torch.equal(key_mask_to_attention_mask(KEEP.long()), KEEP[:, None, None, :])
    with pytest.raises(TypeError, match="key_mask"):
        key_mask_to_bool([1, 0])
    with pytest.raises(ValueError, match=r"attention_mask: .*holding \[2\]"):
        from_hf_attention_mask(KEEP.long() * 2)
    # PyTorch's float key_padding_mask is additive: 0 = keep, -inf = ignore
    assert torch.equal(from_key_padding_mask(AMBIGUOUS["additive"]), KEEP)
    assert torch.equal(from_key_padding_mask(~KEEP), KEEP)
    with pytest.raises(ValueError, match="key_padding_mask"):
        from_key_padding_mask(torch.randn(2, 6))


def test_mha_matches_pytorch_with_a_float_additive_key_padding_mask_converted():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    ours = MultiHeadAttention.from_torch(ref)
    x = torch.randn(2, 6, 8)
    kpm = AMBIGUOUS["additive"]  # PyTorch adds it to the scores
    expected = ref(x, x, x, key_padding_mask=kpm, need_weights=False)[0]
    assert_close(ours(x, key_mask=from_key_padding_mask(kpm)), expected, atol=1e-6)


@pytest.mark.parametrize("name", ["mha_math", "sparse"])
def test_inputs_of_another_dtype_than_the_module_are_named(name):
    layer = _layers()[name]
    x = torch.randn(2, 6, 8)
    with pytest.raises(TypeError, match=r"query: expected the module's dtype torch\.float32, "
                                        r"got torch\.float64"):
        layer(x.double())
    with pytest.raises(TypeError, match=r"key: expected the module's dtype torch\.float32, got "
                                        r"torch\.bfloat16"):
        layer(x, x.bfloat16())
    with pytest.raises(ValueError, match="value: expected the module's device cpu"):
        layer(x, x, torch.randn(2, 6, 8, device="meta"))


def test_mixed_dtypes_are_fine_under_autocast():
    layer = MultiHeadAttention(8, 2)
    x = torch.randn(2, 6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, x.bfloat16())
    assert out.shape == (2, 6, 8)


def test_sparse_and_performer_name_a_key_or_value_of_another_dtype():
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(2))
    features = orthogonal_random_features(8, 4, generator=g)
    with pytest.raises(TypeError, match=r"value: expected query's dtype torch\.float32"):
        sliding_window_attention(q, k, k.double(), 3)
    with pytest.raises(TypeError, match=r"key: expected query's dtype torch\.float32"):
        favor_attention(q, k.bfloat16(), k, features)
