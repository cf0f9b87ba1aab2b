"""``measure_quality`` equals a direct computation of llama.cpp's perplexity recipe on a tiny
model: chunks of N tokens, the second half of each scored, KL(reference || model), top-1."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.quantization import quantize_model
from attnlab.quantization.quality import measure_quality


def tiny(seed: int) -> DecoderLM:
    torch.manual_seed(seed)
    config = DecoderLMConfig.llama(50, d_model=64, num_layers=2, num_heads=4, d_ff=128,
                                   max_len=64)
    return DecoderLM(config).eval()


def direct(model, reference, ids, n):
    """The recipe written out, position by position."""
    nll, kl, same, ref_nll = [], [], [], []
    for c in range(len(ids) // n):
        chunk = ids[c * n:(c + 1) * n]
        with torch.no_grad():
            p = torch.softmax(model(chunk[None])[0].double(), -1)
            q = torch.softmax(reference(chunk[None])[0].double(), -1)
        for t in range(n // 2, n - 1):
            nll.append(-math.log(p[t, chunk[t + 1]]))
            ref_nll.append(-math.log(q[t, chunk[t + 1]]))
            kl.append(float((q[t] * (q[t].log() - p[t].log())).sum()))
            same.append(bool(p[t].argmax() == q[t].argmax()))
    return nll, kl, same, ref_nll


def test_measure_quality_equals_the_direct_computation():
    reference = tiny(0)
    model = quantize_model(tiny(0), "int4", 32)
    ids = torch.randint(0, 50, (100,), generator=torch.Generator().manual_seed(1))
    r = measure_quality(model, ids, context=16, reference=reference)
    nll, kl, same, ref_nll = direct(model, reference, ids, 16)
    assert (r.chunks, r.positions, len(nll)) == (6, 6 * 7, 6 * 7)  # 4 tokens left over
    assert r.perplexity == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)
    assert r.reference_perplexity == pytest.approx(math.exp(sum(ref_nll) / len(ref_nll)),
                                                   rel=1e-5)
    assert r.perplexity_change == pytest.approx(r.perplexity - r.reference_perplexity)
    assert r.kl_mean == pytest.approx(sum(kl) / len(kl), rel=1e-4, abs=1e-7)
    # one position's KL in float32 from log-probabilities of size ~5: ~1e-6 of rounding
    assert r.kl_p99 == pytest.approx(float(torch.quantile(torch.tensor(kl), 0.99)),
                                     rel=1e-4, abs=1e-6)
    assert r.top1 == pytest.approx(sum(same) / len(same))
    assert r.kl_mean > 0 and r.kl_p99 >= r.kl_mean


def test_a_model_against_itself_has_no_divergence():
    model = tiny(2)
    ids = torch.randint(0, 50, (64,), generator=torch.Generator().manual_seed(3))
    r = measure_quality(model, ids, context=32, reference=model)
    assert r.perplexity == r.reference_perplexity and r.top1 == 1.0
    assert abs(r.kl_mean) < 1e-6
    alone = measure_quality(model, ids, context=32)
    assert alone.perplexity == r.perplexity and alone.kl_mean is None
    assert alone.perplexity_change is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"context": 7}, "context: expected an even number of tokens >= 4, got 7"),
    ({"context": 2}, "context: expected an even number of tokens >= 4, got 2"),
    ({"context": 128}, "ids: expected at least context=128 tokens (one chunk), got 64"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        measure_quality(tiny(0), torch.zeros(64, dtype=torch.long), **kwargs)


def test_float_ids_are_refused():
    with pytest.raises(ValueError, match="ids: expected a 1-d integer tensor"):
        measure_quality(tiny(0), torch.zeros(64), context=16)
