"""Sampling functions against their formulas."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.generation import (
    apply_repetition_penalty,
    check_logits,
    check_sampling_args,
    greedy_tokens,
    sample_logits,
    sampling_probs,
    top_k_filter,
    top_p_filter,
    unusable_rows,
)
from conftest import assert_close

NEG = float("-inf")


def test_top_k_keeps_exactly_k_even_with_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = top_k_filter(logits, 2)
    assert (out.isfinite().sum(-1) == 2).all()
    assert (out[0][out[0].isfinite()] == 3.0).all()
    assert out[1].tolist() == [5.0, 4.0, NEG, NEG, NEG]
    assert torch.equal(top_k_filter(logits, 9), logits)
    assert logits[0, 0] == 1.0  # input untouched


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])  # sorted: 0.5, 0.25, 0.15, 0.1
    logits = probs.log()
    for p, kept in ((0.1, {1}), (0.6, {1, 3}), (0.75 - 1e-3, {1, 3}), (0.8, {1, 3, 2}),
                    (0.95, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})):
        out = top_p_filter(logits, p)
        assert set(out.isfinite().nonzero().flatten().tolist()) == kept, p
        assert_close(out[out.isfinite()], logits[out.isfinite()])


def test_sampling_probs_formula() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    T, k, p = 0.7, 5, 0.8
    expected = torch.zeros(3, 10)
    for b in range(3):
        z = (logits[b] / T).tolist()
        top = sorted(range(10), key=lambda i: -z[i])[:k]
        w = {i: math.exp(z[i]) for i in top}
        total = sum(w.values())
        kept, mass = [], 0.0
        for i in sorted(top, key=lambda i: -w[i]):
            if mass >= p:
                break
            kept.append(i)
            mass += w[i] / total
        norm = sum(w[i] for i in kept)
        for i in kept:
            expected[b, i] = w[i] / norm
    assert_close(sampling_probs(logits, T, k, p), expected, atol=1e-6)
    assert_close(sampling_probs(logits), torch.softmax(logits, -1))


def test_sample_logits_follows_the_distribution_and_seed() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    probs = sampling_probs(logits, 1.3, top_k=4)
    g = torch.Generator().manual_seed(0)
    draws = sample_logits(logits.expand(20000, 5), 1.3, top_k=4, generator=g)
    freq = torch.bincount(draws, minlength=5).float() / 20000
    assert freq[3] == 0  # filtered out by top-k
    assert_close(freq, probs, atol=0.015)
    a = sample_logits(logits.expand(50, 5), generator=torch.Generator().manual_seed(7))
    b = sample_logits(logits.expand(50, 5), generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert sample_logits(torch.randn(2, 3, 5)).shape == (2, 3)


def test_repetition_penalty_formula() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, -2.0, 0.0]])
    ids = torch.tensor([[0, 1, 1], [2, 3, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # row 1's token 0 is padding
    out = apply_repetition_penalty(logits, ids, 2.0, mask)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0], [1.0, 1.0, -4.0, 0.0]]
    assert torch.equal(apply_repetition_penalty(logits, ids, 1.0), logits)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"temperature": 0.0}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_k": 0}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": 10**400}, "temperature: expected a finite float > 0"),  # no OverflowError
    ({"top_p": 10**400}, r"top_p: expected None or a float in \(0, 1\]"),
    ({"top_p": True}, "top_p"),
])
def test_sampling_bad_arguments(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        sample_logits(torch.zeros(1, 4), **kwargs)


@pytest.mark.parametrize("penalty", [10**400, float("inf"), float("nan"), 0, True, "1.2"],
                         ids=["10**400", "inf", "nan", "0", "True", "str"])
def test_repetition_penalty_must_be_a_finite_positive_number(penalty) -> None:
    with pytest.raises(ValueError, match="repetition_penalty: expected a finite float > 0"):
        check_sampling_args(1.0, None, None, penalty)


def test_filter_bad_arguments() -> None:
    with pytest.raises(ValueError, match="top_k"):
        top_k_filter(torch.zeros(1, 3), -1)
    with pytest.raises(ValueError, match="top_p"):
        top_p_filter(torch.zeros(1, 3), 0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        apply_repetition_penalty(torch.zeros(1, 3), torch.zeros(1, 1, dtype=torch.long), 0.0)


@pytest.mark.parametrize(("row", "what"), [
    ([0.0, float("nan"), 1.0], "NaN"),
    ([0.0, float("inf"), 1.0], r"\+inf"),
    ([float("-inf")] * 3, "only -inf"),
])
def test_nan_inf_or_all_removed_logits_are_refused(row: list[float], what: str) -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], row])
    with pytest.raises(ValueError, match=f"logits: row 1 \\(of 2\\) holds {what}"):
        sample_logits(logits)
    with pytest.raises(ValueError, match=f"row 1 .* holds {what}"):
        sampling_probs(logits, 0.5, top_k=2)
    with pytest.raises(ValueError, match="my logits: row 1"):
        check_logits(logits, "my logits")
    check_logits(torch.tensor([[0.0, float("-inf"), 1.0]]))  # -inf alone is a removed token
    with pytest.raises(ValueError, match="logits: expected a floating-point tensor"):
        check_logits(torch.tensor([[1, 2]]))


finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=2, max_size=12), st.integers(1, 12))
def test_top_k_never_lets_ties_through(values: list[int], k: int) -> None:
    logits = torch.tensor([values], dtype=torch.float32)
    out = top_k_filter(logits, k)
    kept = out.isfinite()
    assert int(kept.sum()) == min(k, len(values))
    if k < len(values):  # every kept logit >= every removed one
        assert out[kept].min() >= logits[~kept].max()
    probs = sampling_probs(logits, top_k=k)
    assert int((probs > 0).sum()) == min(k, len(values))


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=1, max_size=10),
       st.sampled_from([1e-30, 1e-6, 1e-3, 1e-12, 1.0, 1e3, 1e6, 1e30]),
       st.one_of(st.none(), st.integers(1, 10)),
       st.one_of(st.none(), st.sampled_from([1e-9, 0.5, 0.999999, 1.0]),
                 st.floats(1e-6, 1.0)),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
def test_sampling_probs_is_a_distribution_for_any_setting(values: list[float], T: float,
                                                          k: int | None, p: float | None,
                                                          dtype: torch.dtype) -> None:
    logits = torch.tensor([values]).to(dtype)
    probs = sampling_probs(logits, T, k, p)
    assert probs.dtype in (torch.float32, torch.float64)
    assert bool(probs.isfinite().all()) and bool((probs >= 0).all())
    assert abs(float(probs.sum()) - 1.0) < 1e-5
    # The most likely token always survives the filters; a tiny temperature is greedy.
    best = logits.float().max()
    assert float(probs[0][logits[0].float() == best].sum()) > 0
    others = logits.float()[logits.float() != best]
    if T <= 1e-12 and float((logits.float() == best).sum()) == 1 and (
            not len(others) or float(best - others.max()) / T > 100):
        assert float(probs.max()) == 1.0  # greedy once the gap dwarfs the temperature
    if T >= 1e30 and k is None and p is None:
        assert float((probs - 1 / len(values)).abs().max()) < 1e-5  # uniform
    token = sample_logits(logits, T, k, p, torch.Generator().manual_seed(0))
    assert float(probs[0, int(token)]) > 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=2, max_size=8).filter(lambda w: sum(w) > 0.1),
       st.floats(1e-6, 1.0))
def test_top_p_keeps_the_smallest_prefix_reaching_p(weights: list[float], p: float) -> None:
    probs = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    out = top_p_filter(probs.log(), p)
    kept = out.isfinite()
    order = probs.argsort(descending=True, stable=True)
    mass_before = torch.cumsum(probs[order], 0) - probs[order]
    assert bool(kept[order[0]])  # the most likely token always stays
    expected = torch.zeros_like(kept)
    expected[order] = mass_before < p
    # Float rounding may flip a token whose mass-before is within 1e-6 of p.
    near = (mass_before - p).abs() < 1e-6
    assert torch.equal(kept[order][~near], expected[order][~near])


def test_filters_keep_the_most_likely_token_when_a_temperature_rounds_it_into_a_tie() -> None:
    """(0, 1.2e-17) / 1e30 rounds to (0, 0) in float32: ranked by the scaled values alone,
    top-k and top-p would keep token 0; ranked by the logits they keep token 1."""
    logits = torch.tensor([[0.0, 1.178451627788164e-17]])
    for k, p in ((1, None), (None, 1e-9), (1, 1e-9)):
        assert sampling_probs(logits, 1e30, k, p).tolist() == [[0.0, 1.0]]
    scaled = torch.tensor([[0.0, 0.0]])
    assert top_p_filter(scaled, 1e-9).tolist() == [[0.0, float("-inf")]]
    assert top_p_filter(scaled, 1e-9, rank_by=logits).tolist() == [[float("-inf"), 0.0]]
    assert top_k_filter(scaled, 1, rank_by=logits).tolist() == [[float("-inf"), 0.0]]


def test_a_top_p_below_float32s_smallest_number_keeps_the_most_likely_token() -> None:
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    kept = top_p_filter(logits, 1e-300)
    assert torch.isfinite(kept).sum(-1).tolist() == [1, 1]
    assert torch.equal(kept.argmax(-1), logits.argmax(-1))
    token = sample_logits(logits, 1.0, None, 1e-300, generator=torch.Generator().manual_seed(1))
    assert torch.equal(token.view(-1), logits.argmax(-1))


def _top_p_by_sorting_everything(logits: torch.Tensor, p: float,
                                 keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus written plainly in float64 (stable order by ``keys``): (kept, near), where
    ``near`` marks tokens whose mass-before is within 1e-6 of p (rounding may flip those)."""
    order = keys.argsort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(logits.double(), dim=-1).gather(-1, order)
    mass_before = probs.cumsum(-1) - probs
    kept_sorted = mass_before < p
    kept_sorted[..., 0] = True
    kept = torch.zeros_like(kept_sorted).scatter(-1, order, kept_sorted)
    near = torch.zeros_like(kept_sorted).scatter(-1, order, (mass_before - p).abs() < 1e-6)
    return kept, near


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("spread", [8.0, 3.0, 0.5])  # peaked .. flat: nuclei of a few .. 1000s
@pytest.mark.parametrize("ties", [False, True])
def test_top_p_over_a_large_vocabulary_is_the_nucleus(seed: int, p: float, spread: float,
                                                      ties: bool) -> None:
    """V > 1024: the nucleus found among the top candidates, or by the full sort when it may
    reach past them, is the formula's, ties broken by index (integer logits: many ties)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 5000, generator=g) * spread
    if ties:
        logits = logits.round()
    logits[1] = logits[1].flip(-1)  # another row layout in the same batch
    kept = top_p_filter(logits, p).isfinite()
    expected, near = _top_p_by_sorting_everything(logits, p, logits)
    assert torch.equal(kept[~near], expected[~near])
    ranked = logits * 1e-9  # scaled into ties by a huge temperature; ranked by the logits
    kept = top_p_filter(ranked, p, rank_by=logits).isfinite()
    expected, near = _top_p_by_sorting_everything(ranked, p, logits)
    assert torch.equal(kept[~near], expected[~near])


def test_top_p_searches_the_candidates_first_and_sorts_all_only_when_needed() -> None:
    from attnlab.generation import sampling

    peaked = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0)) * 8
    assert sampling._top_p_among_candidates(peaked, peaked, 0.9) is not None
    flat = torch.zeros(2, 4096)
    assert sampling._top_p_among_candidates(flat, flat, 0.5) is None  # 2048 tokens needed
    assert top_p_filter(flat, 0.5).isfinite().sum(-1).tolist() == [2048, 2048]
    # A tie group straddling the last candidate: decided by the full sort, ties by index.
    straddle = torch.cat([torch.full((1, 1000), 5.0), torch.full((1, 3096), 4.9)], dim=-1)
    kept = top_p_filter(straddle, 0.2).isfinite()
    expected, near = _top_p_by_sorting_everything(straddle, 0.2, straddle)
    assert torch.equal(kept[~near], expected[~near])


@pytest.mark.parametrize(("u", "row", "token"), [
    (0.0, [NEG, 0.0, 0.0, NEG], 1),  # u = 0: the first token of positive probability
    (1 - 2**-24, [0.0, 0.0, NEG, NEG], 1),  # u * total rounds to the total: not a removed one
    (0.5, [0.0, NEG, 0.0, NEG], 2),
])
def test_the_draw_never_picks_a_token_of_probability_zero(monkeypatch, u, row, token) -> None:
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.full(shape, u, dtype=kw["dtype"]))
    assert int(sample_logits(torch.tensor([row]))[0]) == token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("V", [3, 4099])  # a short row, and one over vectorised blocks
def test_unusable_rows_is_the_three_conditions_written_out(dtype, V) -> None:
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(8, V, generator=g).to(dtype)
    where = torch.randint(0, V, (8,), generator=g).tolist()
    logits[0, where[0]] = float("nan")
    logits[1, where[1]] = float("inf")
    logits[2] = float("-inf")
    logits[3, where[3]], logits[3, where[3] - 1] = float("nan"), float("inf")
    logits[4, :V // 2 + 1] = float("-inf")  # removed tokens only: usable
    logits[5, where[5]] = float("-inf")
    logits[6, where[6]], logits[6, where[6] - 1] = float("inf"), float("-inf")
    expected = (logits.isnan().any(-1) | (logits == float("inf")).any(-1)
                | (logits == float("-inf")).all(-1))
    assert expected.tolist() == [True, True, True, True, False, False, True, False]
    assert torch.equal(unusable_rows(logits), expected)
    assert torch.equal(unusable_rows(logits.view(2, 4, V)), expected.view(2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_is_the_first_maximum_of_each_row(dtype) -> None:
    logits = torch.randn(3, 2, 5000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[0, 0, [7, 4000]] = 50.0  # a tie: the first index wins, as argmax says
    logits[1, 1, :] = float("-inf")
    logits[1, 1, 4999] = 0.0
    tokens = greedy_tokens(logits)
    assert tokens.dtype == torch.long and tokens.shape == (3, 2)
    assert torch.equal(tokens, logits.double().argmax(-1))
    assert int(tokens[0, 0]) == 7 and int(tokens[1, 1]) == 4999
