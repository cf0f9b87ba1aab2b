"""Property-based: random shapes, broadcast patterns, masks, layouts and dtypes against
PyTorch's scaled_dot_product_attention in float64, on every backend. Rows with no key to
attend to (masked out, causal with L > S, or S = 0) must give zeros, never NaN."""

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.attention import scaled_dot_product_attention
from attnlab.masks import causal_mask
from conftest import assert_close

BACKENDS = ["math", "flash", "fused", "auto"]
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 0.05}


@st.composite
def problems(draw):
    """query, key, value, mask, is_causal, enable_gqa, with broadcastable leading dims."""
    gqa = draw(st.booleans())
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    G = draw(st.integers(1, 2))
    H = G * draw(st.integers(1, 3)) if gqa else draw(st.integers(1, 3))
    L, S = draw(st.integers(0, 5)), draw(st.integers(0, 6))
    D, Dv = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(list(TOLERANCE)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def operand(heads, length, width):
        """One tensor: some leading dims 1 or dropped, maybe transposed or expanded."""
        dims = [n if draw(st.booleans()) else 1 for n in lead]
        dims = dims[draw(st.integers(0, len(dims))):]  # rank may be lower than the output's
        dims.append(heads if gqa or draw(st.booleans()) else 1)
        shape = (*dims, length, width)
        if draw(st.booleans()):  # non-contiguous: last two dims swapped in memory
            t = torch.randn(*shape[:-2], width, length, generator=g).transpose(-1, -2)
        else:
            t = torch.randn(*shape, generator=g)
        if draw(st.booleans()) and len(dims) > 1 and dims[0] == 1:  # an expanded batch dim
            t = t.expand(len(lead) and lead[-len(dims) + 1], *t.shape[1:])
        return t.to(dtype)

    q = operand(H, L, D)
    k = operand(G if gqa else H, S, D)
    v = operand(G if gqa else H, S, Dv)
    if gqa and (q.dim() < 3 or k.dim() < 3 or v.dim() < 3):
        q, k, v = (t if t.dim() >= 3 else t.unsqueeze(0) for t in (q, k, v))
    try:
        out_lead = torch.broadcast_shapes(q.shape[:-2] if not gqa else q.shape[:-3],
                                          k.shape[:-2] if not gqa else k.shape[:-3],
                                          v.shape[:-2] if not gqa else v.shape[:-3])
    except RuntimeError:
        out_lead = None
    mask = None
    kind = draw(st.sampled_from(["none", "bool", "additive"]))
    if kind != "none" and out_lead is not None:
        full = (*out_lead, *((H,) if gqa else ()), L, S)
        shape = [n if draw(st.booleans()) else 1 for n in full]
        shape = shape[draw(st.integers(0, len(shape))):]
        allowed = torch.rand(tuple(shape), generator=g) > 0.4
        mask = allowed if kind == "bool" else torch.zeros(shape, dtype=dtype).masked_fill(
            ~allowed, float("-inf"))
    return q, k, v, mask, draw(st.booleans()), gqa


def _reference(q, k, v, mask, causal, gqa):
    """PyTorch in float64, our conventions spelled out: bottom-right causal mask, and zeros
    for rows with nothing to attend to. Inputs are expanded to one rank first: PyTorch adds
    the mask in place to ``Q K^T``, so it refuses a mask whose rank comes from value alone."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    tail = 3 if gqa else 2
    lead = torch.broadcast_shapes(*(t.shape[:-tail] for t in (q, k, v)))
    eq, ek, ev = (t.expand(*lead, *t.shape[-tail:]) for t in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    allowed = torch.ones(L, S, dtype=torch.bool)
    if causal:
        allowed = causal_mask(L, S)
    if mask is not None:
        allowed = allowed & (mask if mask.dtype == torch.bool else mask != float("-inf"))
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed,
                                                                           float("-inf"))
    if mask is not None and mask.is_floating_point():
        additive = additive + mask.double().masked_fill(~allowed, 0.0)
    out = F.scaled_dot_product_attention(eq, ek, ev, attn_mask=additive, enable_gqa=gqa)
    has_key = allowed.any(-1, keepdim=True)
    return (q, k, v), torch.where(has_key, out, 0.0), has_key


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.sampled_from(BACKENDS))
def test_every_backend_matches_pytorch_on_random_problems(problem, backend):
    q, k, v, mask, causal, gqa = problem
    if 0 in (q.shape[-2], k.shape[-2]):
        # PyTorch's paths for L = 0 or S = 0 skip some checks and broadcasting (their output
        # may take query's N..): ours broadcast as always and give zeros, zero gradients.
        inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        try:
            out = scaled_dot_product_attention(*inputs, mask, is_causal=causal,
                                               enable_gqa=gqa, backend=backend)
        except ValueError:
            return  # shapes that do not broadcast: refused, as tested below
        assert out.shape[-2:] == (q.shape[-2], v.shape[-1]) and not out.any()
        grads = torch.autograd.grad(out.sum(), inputs, allow_unused=True)
        assert all(g is None or not g.any() for g in grads)
        return
    try:
        (rq, rk, rv), ref, has_key = _reference(q, k, v, mask, causal, gqa)
    except RuntimeError:
        # PyTorch refuses these shapes: so must we, with a ValueError naming the argument.
        try:
            scaled_dot_product_attention(q, k, v, mask, is_causal=causal, enable_gqa=gqa,
                                         backend=backend)
        except ValueError as error:
            assert str(error).split(":")[0] in ("key", "value", "mask", "query")
            return
        raise AssertionError("accepted shapes that PyTorch refuses") from None
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = scaled_dot_product_attention(*inputs, mask, is_causal=causal, enable_gqa=gqa,
                                       backend=backend)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert not torch.isnan(out).any()
    tol = TOLERANCE[q.dtype]
    assert_close(out.double(), ref.detach(), rtol=tol, atol=tol, what=f"{backend} output")
    grad = torch.randn(ref.shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, inputs, grad.to(q.dtype), allow_unused=True)
    for g_ours, x in zip(grads, inputs):
        assert g_ours is None or (g_ours.shape == x.shape and not torch.isnan(g_ours).any())
    if bool(has_key.all()) and ref.numel():
        ref_grads = torch.autograd.grad(ref, (rq, rk, rv), grad)
        for name, a, b in zip("qkv", grads, ref_grads):
            assert_close(a.double(), b, rtol=tol * 4, atol=tol * 4, what=f"{backend} grad {name}")
