"""OpenAI's request controls as pure functions: presence/frequency penalties, logit bias,
min-p, per-row repetition penalty; against their formulas, transformers' processors, and
generate() with them."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from attnlab.generation import apply_repetition_penalty, generate, sampling_probs
from attnlab.generation.processors import (
    apply_logit_bias,
    apply_penalties,
    logit_bias_tensor,
    min_p_filter,
    token_counts,
)
from attnlab.models import DecoderLM, DecoderLMConfig

V = 11


def _logits(B: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_penalties_follow_openai_formula_per_row() -> None:
    logits = _logits()
    generated = torch.tensor([[1, 1, 2, 5], [3, 3, 3, 3], [0, 4, 4, 9]])
    counts = token_counts(generated, V)
    presence, frequency = [0.5, -1.0, 2.0], [1.5, 0.25, -2.0]
    out = apply_penalties(logits, counts, presence, frequency)
    for b in range(3):
        for j in range(V):
            c = int((generated[b] == j).sum())
            expected = logits[b, j] - c * frequency[b] - (c > 0) * presence[b]
            assert out[b, j].item() == pytest.approx(expected.item(), abs=1e-5)
    assert torch.equal(apply_penalties(logits, counts, 0.0, 0.0), logits)
    assert apply_penalties(logits[0], counts[0], 1.0, 0.0).shape == (V,)  # one row


def test_token_counts_skip_masked_positions() -> None:
    ids = torch.tensor([[2, 2, 7]])
    counts = token_counts(ids, V, torch.tensor([[True, False, True]]))
    assert counts[0, 2] == 1 and counts[0, 7] == 1 and counts.sum() == 2


@pytest.mark.parametrize(("name", "kwargs"), [
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -2.01}),
    ("presence_penalty", {"presence_penalty": [0.0, 1.0]}),  # 2 values for 3 rows
])
def test_penalties_refuse_out_of_range_naming_argument(name: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=rf"{name}: expected .*\[-2, 2\]"):
        apply_penalties(_logits(), torch.zeros(3, V), **kwargs)


def test_logit_bias_equals_transformers_sequence_bias_per_row() -> None:
    logits = _logits()
    biases = [{3: 5.0, "7": -100}, None, {0: 100.0}]  # JSON's string keys read as ids
    out = apply_logit_bias(logits, logit_bias_tensor(biases, 3, V))
    for b, bias in enumerate(biases):
        pairs = [[[int(k)], float(v)] for k, v in (bias or {}).items()]
        expected = (SequenceBiasLogitsProcessor(pairs)(torch.zeros(1, 1, dtype=torch.long),
                                                        logits[b:b + 1].clone())
                    if pairs else logits[b:b + 1])
        torch.testing.assert_close(out[b:b + 1], expected)


@pytest.mark.parametrize(("bias", "match"), [
    ({3: 100.5}, r"logit_bias\[3\]: expected a bias in \[-100, 100\]"),
    ({V: 1.0}, rf"logit_bias: expected token ids in \[0, {V}\)"),
    ({"x": 1.0}, r"logit_bias: expected token ids"),
    ([{1: 1.0}], r"logit_bias: expected a mapping .* or a list of 3"),
])
def test_logit_bias_refuses_bad_entries(bias: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        logit_bias_tensor(bias, 3, V)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_equals_transformers_warper(min_p: float) -> None:
    logits = _logits(4, seed=1)
    expected = MinPLogitsWarper(min_p)(None, logits.clone())
    assert torch.equal(min_p_filter(logits, min_p).isfinite(), expected.isfinite())


def test_min_p_per_row_and_in_sampling_after_temperature() -> None:
    logits = _logits(2, seed=2)
    out = min_p_filter(logits, [0.0, 0.5])
    assert out[0].isfinite().all()
    torch.testing.assert_close(out[1], MinPLogitsWarper(0.5)(None, logits[1:].clone())[0])
    # sampling_probs applies it to logits / T, as transformers' order does
    probs = sampling_probs(logits, 2.0, min_p=0.5)
    kept = MinPLogitsWarper(0.5)(None, logits.clone() / 2.0).isfinite()
    assert torch.equal(probs > 0, kept)
    with pytest.raises(ValueError, match=r"min_p: expected a number in \[0, 1\]"):
        min_p_filter(logits, 1.5)


def test_repetition_penalty_per_row_equals_transformers() -> None:
    logits = _logits()
    ids = torch.tensor([[1, 2, 3], [4, 4, 5], [6, 7, 8]])
    penalties = [1.0, 1.3, 0.7]
    out = apply_repetition_penalty(logits, ids, torch.tensor(penalties))
    for b, p in enumerate(penalties):
        expected = RepetitionPenaltyLogitsProcessor(p)(ids[b:b + 1], logits[b:b + 1].clone())
        torch.testing.assert_close(out[b:b + 1], expected)
    with pytest.raises(ValueError, match="repetition_penalty: expected a finite number > 0"):
        apply_repetition_penalty(logits, ids, [1.0, 0.0, 1.0])


def _model() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4,
                                           max_len=24)).eval()


def test_generate_applies_bias_and_penalties_like_a_plain_loop() -> None:
    """generate's greedy tokens equal a loop over the model's logits with the formulas."""
    model, prompt = _model(), torch.tensor([[1, 2, 3]])
    bias = {4: 3.0, 5: -100.0}
    out = generate(model, prompt, 8, presence_penalty=1.5, frequency_penalty=0.5,
                   logit_bias=bias)
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            logits = model(ids)[:, -1]
            counts = token_counts(ids[:, 3:], V)
            logits = logits - 0.5 * counts - 1.5 * (counts > 0).float()
            logits[:, 4] += 3.0
            logits[:, 5] -= 100.0
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    assert out.tolist() == ids.tolist()
    assert 5 not in out[0, 3:].tolist()


def test_generate_refuses_controls_by_name() -> None:
    model, prompt = _model(), torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match=r"frequency_penalty: expected a number in \[-2, 2\]"):
        generate(model, prompt, 2, frequency_penalty=3)
    with pytest.raises(ValueError, match=r"logit_bias\[2\]: expected a bias in \[-100, 100\]"):
        generate(model, prompt, 2, logit_bias={2: -101})
    with pytest.raises(ValueError, match="min_p: not available with speculative decoding"):
        generate(model, prompt, 2, min_p=0.1, do_sample=True, prompt_lookup_num_tokens=2)


def test_generate_min_p_one_is_greedy_when_sampling() -> None:
    """min_p = 1 keeps only the most likely token: sampling then gives the greedy tokens."""
    model, prompt = _model(), torch.tensor([[1, 2, 3]])
    sampled = generate(model, prompt, 6, do_sample=True, min_p=1.0, seed=0)
    assert sampled.tolist() == generate(model, prompt, 6).tolist()
