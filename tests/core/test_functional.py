"""scaled_dot_product_attention: every backend against PyTorch's kernel and our math, forward
and backward, on every kind of input the API accepts."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention import scaled_dot_product_attention
from attnlab.attention.flash import flash_attention
from attnlab.functional import linear, softmax
from attnlab.masks import causal_mask
from conftest import assert_close

BACKENDS = ["math", "flash", "fused", "auto"]


def reference(q, k, v, mask=None, is_causal=False, scale=None):
    """PyTorch's kernel with our conventions spelled out: heads repeated for GQA, the causal
    mask bottom-right and explicit."""
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        r = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
    L, S = q.shape[-2], k.shape[-2]
    if is_causal:
        c = causal_mask(L, S)
        if mask is None:
            mask = c
        elif mask.dtype == torch.bool:
            mask = mask & c
        else:
            mask = mask.masked_fill(~c, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def make(shape_q, shape_k, dv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=g, dtype=dtype)
    k = torch.randn(*shape_k, generator=g, dtype=dtype)
    v = torch.randn(*shape_k[:-1], dv or shape_k[-1], generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


CASES = {
    # name: (q shape, k shape, Dv, mask builder, is_causal, enable_gqa)
    "rank4": ((2, 3, 5, 8), (2, 3, 5, 8), None, None, False, False),
    "rank2_no_heads": ((5, 8), (7, 8), None, None, False, False),
    "rank3": ((3, 5, 8), (3, 7, 8), None, None, False, False),
    "rank5_leading": ((2, 2, 3, 4, 8), (2, 2, 3, 6, 8), 4, None, False, False),
    "L_ne_S_Dv_ne_D": ((2, 2, 5, 8), (2, 2, 11, 8), 6, None, False, False),
    "causal_square": ((2, 2, 9, 8), (2, 2, 9, 8), None, None, True, False),
    "causal_kv_longer": ((2, 2, 3, 8), (2, 2, 10, 8), None, None, True, False),
    "causal_q_longer": ((1, 2, 10, 8), (1, 2, 4, 8), None, None, True, False),
    "bool_mask": ((2, 2, 5, 8), (2, 2, 6, 8), None, "bool", False, False),
    "float_mask": ((2, 2, 5, 8), (2, 2, 6, 8), None, "float", False, False),
    "bias_mask": ((2, 2, 5, 8), (2, 2, 6, 8), None, "bias", False, False),
    "key_mask_broadcast": ((2, 2, 5, 8), (2, 2, 6, 8), None, "key", False, False),
    "mask_and_causal": ((2, 2, 6, 8), (2, 2, 6, 8), None, "bool", True, False),
    "gqa": ((2, 6, 5, 8), (2, 2, 7, 8), None, None, False, True),
    "gqa_causal_mask": ((2, 4, 5, 8), (2, 2, 9, 8), 3, "bool", True, True),
    "mqa": ((2, 4, 5, 8), (2, 1, 5, 8), None, "float", True, True),
}


def build_mask(kind, q, k):
    L, S = q.shape[-2], k.shape[-2]
    g = torch.Generator().manual_seed(1)
    if kind is None:
        return None
    if kind == "key":
        m = torch.rand(q.shape[0], 1, 1, S, generator=g) > 0.3
        m[..., 0] = True
        return m
    m = torch.rand(L, S, generator=g) > 0.3
    m[:, -1] = True  # every row keeps a key (fully masked rows are tested separately)
    if kind == "bool":
        return m
    add = torch.zeros(L, S).masked_fill(~m, float("-inf"))
    if kind == "bias":
        add = add + torch.randn(L, S, generator=g)
    return add


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_pytorch_forward_and_backward(backend, case):
    shape_q, shape_k, dv, mask_kind, causal, gqa = CASES[case]
    q, k, v = make(shape_q, shape_k, dv)
    mask = build_mask(mask_kind, q, k)
    out = scaled_dot_product_attention(
        q, k, v, mask, is_causal=causal, enable_gqa=gqa, backend=backend
    )
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = reference(q, k, v, mask, causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    assert out.shape == ref.shape
    assert_close(out, ref, atol=1e-5, what=f"{backend} output")
    for name, a, b in zip("qkv", grads, ref_grads):
        assert_close(a, b, atol=1e-5, what=f"{backend} grad {name}")


@pytest.mark.parametrize("case", ["rank4", "causal_kv_longer", "gqa_causal_mask", "bias_mask"])
def test_flash_gradcheck_float64_with_small_tiles(case):
    shape_q, shape_k, dv, mask_kind, causal, _ = CASES[case]
    q, k, v = make(shape_q, shape_k, dv, dtype=torch.float64)
    mask = build_mask(mask_kind, q, k)
    if mask is not None and mask.is_floating_point():
        mask = mask.double()

    def fn(q, k, v):
        return flash_attention(q, k, v, mask, is_causal=causal, scale=0.3, block_q=2, block_k=3)

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("blocks", [(1, 1), (2, 5), (4, 4), (64, 64)])
def test_flash_tile_sizes_do_not_change_the_result(blocks):
    q, k, v = make((1, 4, 13, 8), (1, 2, 17, 8), dtype=torch.float64)
    mask = torch.rand(13, 17, generator=torch.Generator().manual_seed(3)) > 0.2
    out = flash_attention(
        q, k, v, mask, is_causal=True, scale=0.5, block_q=blocks[0], block_k=blocks[1]
    )
    ref = reference(q, k, v, mask, True, scale=0.5)
    assert_close(out, ref)


def test_flash_is_exact_with_peaked_and_far_apart_scores():
    # Scores spanning hundreds of units exercise the online rescaling and the exp floor.
    q, k, v = make((1, 2, 40, 8), (1, 2, 40, 8), dtype=torch.float64)
    q = (q * 30).detach()
    for blocks in [(8, 8), (40, 5)]:
        out = flash_attention(
            q, k, v, None, is_causal=True, scale=1.0, block_q=blocks[0], block_k=blocks[1]
        )
        assert_close(out, reference(q, k, v, None, True, scale=1.0))


@pytest.mark.parametrize("growth", [2.0, 30.0, 200.0])
def test_flash_is_exact_when_later_keys_outscore_the_first_tiles(growth):
    # Scores rising tile after tile pass the reference by more than the margin: the tiles
    # whose row max is not computed must be noticed and redone, forward and backward.
    q, k, v = make((1, 2, 24, 8), (1, 2, 48, 8), dtype=torch.float64)
    ramp = torch.linspace(0.0, growth, 48, dtype=torch.float64).view(1, 1, 48, 1)
    q = q.detach().abs().requires_grad_()
    k = (k.detach().abs() * ramp).requires_grad_()
    for blocks in [(8, 4), (24, 16)]:
        out = flash_attention(q, k, v, None, scale=1.0, block_q=blocks[0], block_k=blocks[1])
        ref = reference(q, k, v, None, False, scale=1.0)
        assert_close(out, ref)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
        for name, a, b in zip("qkv", grads, ref_grads):
            assert_close(a, b, what=f"grad {name}")


def test_flash_is_exact_when_every_score_of_a_row_is_far_below_zero():
    # Rows whose scores all lie near -1000 (a large negative bias) must take their own max as
    # reference: with a reference of 0 every weight would fall under the exp floor.
    q, k, v = make((1, 2, 6, 8), (1, 2, 20, 8), dtype=torch.float64)
    bias = torch.zeros(6, 20, dtype=torch.float64)
    bias[::2] = -1000.0 + torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    bias[1, :7] = float("-inf")  # and a row whose first tiles have no key at all
    out = flash_attention(q, k, v, bias, scale=0.5, block_q=4, block_k=7)
    assert_close(out, reference(q, k, v, bias, False, scale=0.5))


@pytest.mark.parametrize(("dtype", "peak"), [(torch.float16, 4.0), (torch.bfloat16, 1.0)])
def test_flash_in_half_precision_matches_float32(dtype, peak):
    # Peaked float16 scores would overflow sums kept in float16; bfloat16 has float32's range
    # but rounds scores to 8 bits, so it gets milder ones.
    q, k, v = make((1, 2, 40, 16), (1, 2, 40, 16))
    q32 = (q * peak).detach()
    out = flash_attention(q32.to(dtype), k.to(dtype), v.to(dtype), is_causal=True,
                          scale=1.0, block_q=16, block_k=8)
    assert out.dtype == dtype
    ref = reference(q32, k, v, None, True, scale=1.0)
    assert_close(out.float(), ref, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
def test_fully_masked_rows_give_zeros_never_nan(backend, mask_dtype):
    q, k, v = make((2, 2, 4, 8), (2, 2, 5, 8))
    allowed = torch.ones(2, 1, 4, 5, dtype=torch.bool)
    allowed[0, :, 1] = False  # query 1 of batch 0 sees nothing
    allowed[1, :, 3] = False
    mask = (
        allowed
        if mask_dtype == torch.bool
        else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    )
    out = scaled_dot_product_attention(q, k, v, mask, backend=backend)
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, :, 1], torch.zeros(2, 8))
    assert torch.equal(out[1, :, 3], torch.zeros(2, 8))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(not torch.isnan(g).any() for g in grads)
    assert torch.equal(grads[0][0, :, 1], torch.zeros(2, 8))


def test_causal_query_longer_than_keys_gives_zero_rows():
    q, k, v = make((1, 1, 6, 4), (1, 1, 2, 4))
    for backend in BACKENDS:
        out = scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
        assert torch.equal(out[0, 0, :4], torch.zeros(4, 4)), backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_mask", [False, True])
def test_one_causal_query_sees_every_key(backend, with_mask):
    """A decoding step: the one query is the last position, so the bottom-right causal mask
    hides nothing (the library drops it); with a key mask, only that mask counts."""
    q, k, v = make((2, 4, 1, 8), (2, 2, 7, 8))
    mask = torch.tensor([[True] * 7, [False, False, True, True, True, True, True]])[:, None,
                                                                                   None]
    mask = mask if with_mask else None
    out = scaled_dot_product_attention(q, k, v, mask, is_causal=True, enable_gqa=True,
                                       backend=backend)
    assert_close(out, reference(q, k, v, mask, is_causal=True))
    plain = scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, backend=backend)
    assert torch.equal(out, plain)


def test_no_keys_at_all_gives_zero_rows():
    q, k, v = make((1, 2, 3, 4), (1, 2, 0, 4))
    for backend in BACKENDS:
        out = scaled_dot_product_attention(q, k, v, backend=backend)
        assert torch.equal(out, torch.zeros(1, 2, 3, 4)), backend
        out.sum().backward()
        assert torch.equal(q.grad, torch.zeros_like(q)), backend
        q.grad = None
    assert softmax(torch.zeros(2, 0)).shape == (2, 0)


def test_weights_are_the_softmax_and_multiply_the_values():
    q, k, v = make((2, 3, 5, 8), (2, 3, 6, 8))
    mask = build_mask("bool", q, k)
    out, w = scaled_dot_product_attention(q, k, v, mask, is_causal=True, return_weights=True)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    scores = scores.masked_fill(~(mask & causal_mask(5, 6)), float("-inf"))
    assert_close(w, torch.softmax(scores, dim=-1))
    assert_close(out, w @ v)
    assert w.shape == (2, 3, 5, 6)


def test_weights_with_gqa_have_query_heads():
    q, k, v = make((1, 6, 4, 8), (1, 2, 5, 8))
    out, w = scaled_dot_product_attention(q, k, v, enable_gqa=True, return_weights=True)
    assert w.shape == (1, 6, 4, 5)
    assert_close(out, w @ v.repeat_interleave(3, dim=1))


def test_dropout_weights_are_the_ones_applied_and_seeded():
    q, k, v = make((2, 2, 6, 8), (2, 2, 6, 8))
    torch.manual_seed(5)
    out, w = scaled_dot_product_attention(q, k, v, dropout_p=0.5, return_weights=True)
    assert_close(out, w @ v)
    dropped = (w == 0).float().mean().item()
    assert 0.3 < dropped < 0.7
    kept = w[w != 0]
    plain = scaled_dot_product_attention(q, k, v, return_weights=True)[1]
    assert_close(kept, 2 * plain[w != 0])  # inverted dropout scales by 1 / (1 - p)
    torch.manual_seed(5)
    again = scaled_dot_product_attention(q, k, v, dropout_p=0.5, return_weights=True)[1]
    assert torch.equal(w, again)


def test_custom_scale():
    q, k, v = make((1, 2, 4, 8), (1, 2, 4, 8))
    for backend in BACKENDS:
        out = scaled_dot_product_attention(q, k, v, scale=0.05, backend=backend)
        assert_close(out, reference(q, k, v, scale=0.05), atol=1e-5)


def test_auto_returns_weights_through_math_and_equals_fused_otherwise():
    q, k, v = make((1, 2, 4, 8), (1, 2, 4, 8))
    result = scaled_dot_product_attention(q, k, v, return_weights=True)
    assert isinstance(result, tuple)
    auto = scaled_dot_product_attention(q, k, v, is_causal=True)
    fused = scaled_dot_product_attention(q, k, v, is_causal=True, backend="fused")
    assert torch.equal(auto, fused)


def test_linear_matches_torch():
    x = torch.randn(2, 3, 5)
    w, b = torch.randn(4, 5), torch.randn(4)
    assert_close(linear(x, w, b), F.linear(x, w, b))
    assert_close(linear(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="weight"):
        linear(x, torch.randn(4, 6))
    with pytest.raises(ValueError, match="bias"):
        linear(x, w, torch.randn(5))


def test_softmax_matches_torch_and_is_stable():
    x = torch.randn(3, 7) * 50 + 1000  # exp would overflow without the max subtraction
    assert_close(softmax(x), torch.softmax(x, -1))
    assert_close(softmax(x, dim=0), torch.softmax(x, 0))
    x = torch.tensor([[0.0, float("-inf")], [float("-inf"), float("-inf")]], requires_grad=True)
    y = softmax(x)
    assert torch.equal(y.detach(), torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    y.sum().backward()
    assert not torch.isnan(x.grad).any()


def _qkv():
    return make((2, 4, 5, 8), (2, 2, 6, 8))


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"query": torch.randn(8)}, ValueError, "query"),
        (
            {"key": torch.randn(2, 3, 6, 8), "value": torch.randn(2, 3, 6, 8), "enable_gqa": False},
            ValueError,
            "enable_gqa=True",
        ),
        (
            {"key": torch.randn(3, 2, 6, 8), "value": torch.randn(3, 2, 6, 8)},
            ValueError,
            "leading dims",
        ),
        ({"key": torch.randn(2, 2, 6, 9), "value": torch.randn(2, 2, 6, 9)}, ValueError, "key"),
        ({"value": torch.randn(2, 2, 7, 8)}, ValueError, "value"),
        ({"key": torch.randn(2, 2, 6, 8, 1)}, ValueError, "key: expected head dim"),
        ({"enable_gqa": False}, ValueError, "enable_gqa"),
        (
            {"key": torch.randn(2, 3, 6, 8), "value": torch.randn(2, 3, 6, 8)},
            ValueError,
            "multiple",
        ),
        ({"mask": torch.ones(5, 7, dtype=torch.bool)}, ValueError, "mask"),
        ({"mask": torch.ones(5, 6, dtype=torch.long)}, TypeError, "mask"),
        ({"backend": "cuda"}, ValueError, "backend"),
        ({"backend": "flash", "return_weights": True}, ValueError, "return_weights"),
        ({"backend": "fused", "return_weights": True}, ValueError, "return_weights"),
        ({"backend": "flash", "dropout_p": 0.1}, ValueError, "dropout_p"),
        ({"dropout_p": 1.5}, ValueError, "dropout_p"),
        ({"dropout_p": True}, TypeError, "dropout_p"),
        ({"dropout_p": 10**400}, ValueError, "dropout_p: expected a float in"),
        ({"scale": 10**400}, ValueError, "scale: expected a finite float"),
        ({"scale": float("nan")}, ValueError, "scale: expected a finite float, got nan"),
        ({"query": torch.ones(2, 4, 5, 8, dtype=torch.long)}, TypeError, "query"),
        ({"key": torch.randn(2, 2, 6, 8, dtype=torch.float64)}, TypeError, "dtype"),
    ],
)
def test_bad_input_raises_naming_the_argument(kwargs, error, name):
    q, k, v = _qkv()
    args = {"query": q, "key": k, "value": v, "enable_gqa": True, **kwargs}
    with pytest.raises(error, match=name):
        scaled_dot_product_attention(**args)


def test_flash_refuses_a_mask_that_needs_gradients():
    q, k, v = _qkv()
    bias = torch.zeros(5, 6, requires_grad=True)
    with pytest.raises(ValueError, match="mask"):
        scaled_dot_product_attention(q, k, v, bias, enable_gqa=True, backend="flash")
    # auto goes to a backend that can differentiate the bias
    out = scaled_dot_product_attention(q, k, v, bias, enable_gqa=True)
    out.sum().backward()
    assert bias.grad is not None
