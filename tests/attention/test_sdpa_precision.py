"""bfloat16 / float16 attention is computed in float32 (scores, softmax statistics, sums) on
every backend: its error against a float64 reference stays near the rounding of the output,
forward and backward, even on peaked scores."""

import pytest
import torch
import torch.nn.functional as F

from attnlab.attention import scaled_dot_product_attention
from attnlab.attention.flash import flash_attention

BACKENDS = ["math", "flash", "fused", "auto"]
# Max abs error on unit-scale values (outputs; gradients relative to their largest entry).
BOUNDS = {torch.bfloat16: 0.02, torch.float16: 0.005}


def _peaked(dtype, peak, seed=0):
    """q, k, v, dO in ``dtype``: queries scaled by ``peak`` make each softmax row peaked
    (score spread ~``peak``), where rounding scores to 8 or 11 bits hurts most."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(2, 4, 64, 32, generator=g) for _ in range(4))
    return [t.to(dtype) for t in (q * peak, k, v, do)]


def _max_error(actual, expected, relative=False):
    err = (actual.double() - expected).abs().max().item()
    return err / expected.abs().max().item() if relative else err


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("peak", [1.0, 10.0])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_half_precision_error_against_float64_is_bounded(dtype, backend, peak, causal):
    q, k, v, do = _peaked(dtype, peak)
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, exact, do.double())
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = scaled_dot_product_attention(*inputs, is_causal=causal, backend=backend)
    assert out.dtype == dtype
    bound = BOUNDS[dtype]
    assert _max_error(out, ref) <= bound
    grads = torch.autograd.grad(out, inputs, do)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert a.dtype == dtype
        assert _max_error(a, b, relative=True) <= bound, name


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_math_weights_come_back_in_the_input_dtype_and_accurate(dtype):
    q, k, v, _ = _peaked(dtype, 10.0)
    mask = torch.rand(64, 64, generator=torch.Generator().manual_seed(1)) > 0.2
    out, weights = scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    assert weights.dtype == dtype and out.dtype == dtype
    scores = (q.double() @ k.double().transpose(-2, -1)) / 32**0.5
    ref = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    assert _max_error(weights, ref) <= BOUNDS[dtype]


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_flash_half_precision_with_small_tiles_masks_and_gqa(dtype):
    # Many tiles: the running max/sum and the rescaling all happen in float32.
    q, k, v, do = _peaked(dtype, 10.0, seed=3)
    k, v = k[:, :2], v[:, :2]
    bias = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    bias[:, 5:9] = float("-inf")
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    scale = 32**-0.5
    ref = F.scaled_dot_product_attention(*exact, attn_mask=bias.double(), enable_gqa=True,
                                         scale=scale)
    ref_grads = torch.autograd.grad(ref, exact, do.double())
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*inputs, bias, scale=scale, block_q=8, block_k=16)
    assert _max_error(out, ref) <= BOUNDS[dtype]
    for name, a, b in zip("qkv", torch.autograd.grad(out, inputs, do), ref_grads):
        assert _max_error(a, b, relative=True) <= BOUNDS[dtype], name
