"""Fair scheduling between groups of requests (``SamplingParams.group``, the ``n`` choices of
one HTTP request), counted in scheduler steps: a newcomer is prefilled in the first step
after it arrives while a request of 16 choices runs, groups share the batch within one slot
of each other, the prefill budget goes shortest first above a floor that bounds every
prompt's wait, and greedy tokens stay those of ``generate`` run alone."""

from __future__ import annotations

import functools
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import V, _model

from attnlab.generation import generate
from attnlab.serving import Engine, SamplingParams
from attnlab.serving.engine import MIN_REQUEST_TOKENS
from attnlab.serving.scheduler import prefill_shares

# The scheduler's bound (its module docstring): a request of a group that runs nothing is
# admitted and computes prompt tokens in the first step after it arrives.
K = 1


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(V) for _ in range(length)]


@functools.cache
def _reference(prompt: tuple[int, ...], new: int) -> list[int]:
    ids = generate(_model(), torch.tensor([prompt]), new)
    return ids[0, len(prompt):].tolist()


def _greedy(new: int, group: str | None = None) -> SamplingParams:
    return SamplingParams(new, temperature=0, group=group)


def _drain(engine: Engine, tokens: dict[str, list[int]]) -> None:
    """Step until nothing is left, appending every token to ``tokens[request_id]``."""
    for _ in range(2000):
        if not engine.has_work():
            return
        for event in engine.step():
            if event.token_id is not None:
                tokens[event.request_id].append(event.token_id)
    raise AssertionError("the engine made no progress")


def _running_per_group(engine: Engine) -> Counter:
    return Counter(r.params.group for r in engine.scheduler.running)


def test_a_newcomer_is_prefilled_within_k_steps_while_sixteen_choices_run():
    engine = Engine(_model(), max_batch=4, max_tokens_per_step=6, page_size=4)
    big_prompt, small_prompt = _prompt(17, 1), _prompt(26, 2)
    tokens: dict[str, list[int]] = {}
    for _ in range(16):  # one request of n=16 choices, each 20 new tokens
        tokens[engine.add_request(big_prompt, _greedy(20, "big"))] = []
    for _ in range(5):
        for event in engine.step():
            tokens[event.request_id].append(event.token_id)
    assert _running_per_group(engine) == {"big": 4}
    small = engine.add_request(small_prompt, _greedy(6, "small"))
    tokens[small] = []
    request = next(r for r in engine.scheduler.waiting if r.request_id == small)
    for _ in range(K):
        for event in engine.step():
            tokens[event.request_id].append(event.token_id)
    assert request in engine.scheduler.running and request.computed > 0
    # the big request gave up one of its 4 slots (its newest choice waits again)
    assert _running_per_group(engine) == {"big": 3, "small": 1}
    _drain(engine, tokens)
    assert tokens.pop(small) == _reference(tuple(small_prompt), 6)
    assert all(t == _reference(tuple(big_prompt), 20) for t in tokens.values())
    assert engine.stats()["pages_used"] == 0


def test_without_groups_arrival_order_is_kept():
    # every request a group alone: first come, first served, as before groups existed
    engine = Engine(_model(), max_batch=2, max_tokens_per_step=4, page_size=4)
    ids = [engine.add_request(_prompt(3, i), _greedy(4)) for i in range(4)]
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ids[:2]


def test_two_groups_share_the_batch_within_one_slot():
    engine = Engine(_model(), max_batch=4, max_tokens_per_step=8, page_size=4)
    for _ in range(8):
        engine.add_request(_prompt(5, 3), _greedy(10, "a"))
    engine.step()
    assert _running_per_group(engine) == {"a": 4}
    for _ in range(8):
        engine.add_request(_prompt(7, 4), _greedy(10, "b"))
    engine.step()
    assert _running_per_group(engine) == {"a": 2, "b": 2}
    engine.step()  # balanced: nobody is paused again
    assert _running_per_group(engine) == {"a": 2, "b": 2}
    assert engine.stats()["preemptions"] == 2


def test_prefilling_requests_go_shortest_first_above_a_floor():
    # floor max(1, 24 // 12) = 2: the 3-token prompt whole, 2 for each long one, the 17 left
    # to the first long one (arrival order breaks the tie)
    engine = Engine(_model(), max_batch=3, max_tokens_per_step=24, page_size=4)
    for length, seed in ((26, 5), (3, 6), (26, 7)):
        engine.add_request(_prompt(length, seed), _greedy(4))
    engine.step()
    assert [r.computed for r in engine.scheduler.running] == [19, 3, 2]


def test_a_short_prompt_is_not_held_up_behind_a_long_one():
    engine = Engine(_model(), max_batch=4, max_tokens_per_step=16, page_size=4)
    engine.add_request(_prompt(40, 1), _greedy(4), request_id="long")
    engine.step()
    engine.add_request(_prompt(9, 2), _greedy(4), request_id="short")
    events = engine.step()  # "long"'s floor of 1, the other 15 cover "short"'s 9 first
    assert [e.request_id for e in events] == ["short"]


def test_the_floor_bounds_a_long_prompts_wait_while_short_ones_keep_arriving():
    # budget 48, 3 slots: floor 4; a 40-token prompt is stored within ceil(40 / 4) = 10 steps
    # although two new 30-token requests arrive at every step and go first while shorter
    engine = Engine(_model(), max_batch=3, max_tokens_per_step=48, page_size=4)
    engine.add_request(_prompt(40, 1), _greedy(2), request_id="long")
    for step in range(10):
        for i in range(2):
            engine.add_request(_prompt(30, 100 + 2 * step + i), _greedy(1))
        if any(e.request_id == "long" for e in engine.step()):
            break
    else:
        pytest.fail("the long prompt waited more than ceil(40 / floor) steps")


@pytest.mark.parametrize(("budget", "wants", "floor", "shares"), [
    (10, [2, 26, 26], 3, [2, 5, 3]),
    (11, [26, 2, 26], 3, [6, 2, 3]),  # the rest goes in priority order
    (100, [3, 7], 5, [3, 7]),                          # enough for all
    (5, [], 1, []),
    (2, [4, 1], 1, [1, 1]),
])
def test_prefill_shares_examples(budget, wants, floor, shares):
    assert prefill_shares(budget, wants, floor) == shares


@given(wants=st.lists(st.integers(1, 40), max_size=6), floor=st.integers(1, 8),
       extra=st.integers(0, 60))
def test_prefill_shares_gives_every_floor_then_the_rest_in_order(wants, floor, extra):
    budget = len(wants) * floor + extra
    shares = prefill_shares(budget, wants, floor)
    assert sum(shares) == min(budget, sum(wants))
    assert all(min(w, floor) <= s <= w for w, s in zip(wants, shares))
    for i, (w, s) in enumerate(zip(wants, shares)):  # above its floor only if all before are full
        if s > min(w, floor):
            assert all(sh == wa for wa, sh in zip(wants[:i], shares[:i]))


def test_prefill_shares_refuses_floors_beyond_the_budget():
    with pytest.raises(ValueError, match="floor"):
        prefill_shares(3, [5, 5], 2)


@settings(max_examples=30, deadline=None)
@given(groups=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 8), st.integers(1, 30)),
                       min_size=1, max_size=4),
       max_batch=st.integers(1, 4), extra_budget=st.integers(0, 6),
       page_size=st.sampled_from([2, 4]), spare_pages=st.sampled_from([0, 3, None]))
def test_groups_arriving_at_any_step_get_the_greedy_tokens_of_generate(
        groups, max_batch, extra_budget, page_size, spare_pages):
    # groups: (choices, arrival step, prompt length); every choice makes 8 new tokens
    new = 8
    longest = -(-(max(length for _, _, length in groups) + new) // page_size)
    engine = Engine(_model(), max_batch=max_batch, max_tokens_per_step=max_batch + extra_budget,
                    page_size=page_size,
                    kv_pages=None if spare_pages is None
                    else max(longest + spare_pages, -(-MIN_REQUEST_TOKENS // page_size)))
    prompts = [_prompt(length, i) for i, (_, _, length) in enumerate(groups)]
    expected, tokens = {}, {}
    step = 0
    while step <= max(arrival for _, arrival, _ in groups) or engine.has_work():
        for g, (choices, arrival, _) in enumerate(groups):
            if arrival == step:
                for _ in range(choices):
                    request_id = engine.add_request(prompts[g], _greedy(new, f"g{g}"))
                    expected[request_id], tokens[request_id] = g, []
        for event in engine.step():
            tokens[event.request_id].append(event.token_id)
        step += 1
        assert step < 2000, "the engine made no progress"
    for request_id, g in expected.items():
        assert tokens[request_id] == _reference(tuple(prompts[g]), new)
    assert engine.stats()["pages_used"] == 0
