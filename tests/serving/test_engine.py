"""The engine against one-at-a-time ``attnlab.generation.generate``: greedy tokens identical
for any arrival order, batch size, token budget, page pressure and prefix sharing; seeded
sampling reproducible whatever else runs; every page returned."""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.generation import generate
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.serving import Engine, SamplingParams

V = 61
LENGTHS = (3, 17, 1, 9, 26, 5)  # prompts, some longer than a page or several
NEW = 6


@functools.cache
def _model() -> DecoderLM:
    torch.manual_seed(0)
    # weights far from uniform, so that greedy choices are not near-ties that rounding flips
    config = DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4, max_len=48,
                                   initializer_range=0.3)
    return DecoderLM(config).eval()


@functools.cache
def _prompts() -> tuple[tuple[int, ...], ...]:
    rng = random.Random(0)
    return tuple(tuple(rng.randrange(V) for _ in range(n)) for n in LENGTHS)


@functools.cache
def _reference(prompt: tuple[int, ...], new: int = NEW, **kwargs) -> list[int]:
    ids = generate(_model(), torch.tensor([prompt]), new, **kwargs)
    return ids[0, len(prompt):].tolist()


def _run(engine: Engine, arrivals: list[tuple[int, list[int], SamplingParams]]
         ) -> dict[str, list]:
    """Add each request at its step (``arrivals``: step, prompt, params); step until done.
    ``{id: [(token, finish_reason), ...]}`` in the order of ``arrivals``."""
    out, step = {}, 0
    ids: list[str | None] = [None] * len(arrivals)
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    while pending or engine.has_work():
        while pending and arrivals[pending[0]][0] <= step:
            i = pending.pop(0)
            ids[i] = engine.add_request(arrivals[i][1], arrivals[i][2])
            out[ids[i]] = []
        for event in engine.step():
            out[event.request_id].append((event.token_id, event.finish_reason))
        step += 1
        assert step < 500, "the engine made no progress"
    return {i: out[i] for i in ids}


def _tokens(events: list) -> list[int]:
    return [t for t, _ in events]


GREEDY = SamplingParams(NEW, temperature=0)


@settings(max_examples=25, deadline=None)
@given(order=st.permutations(range(len(LENGTHS))),
       delays=st.lists(st.integers(0, 6), min_size=len(LENGTHS), max_size=len(LENGTHS)),
       max_batch=st.integers(1, 4), extra_budget=st.integers(0, 12),
       page_size=st.sampled_from([2, 4, 16]), spare_pages=st.sampled_from([0, 2, None]))
def test_batched_greedy_equals_generate_one_at_a_time(order, delays, max_batch, extra_budget,
                                                      page_size, spare_pages):
    # spare_pages: the pool holds the longest request and that many pages more (None: plenty)
    longest = -(-(max(LENGTHS) + NEW) // page_size)
    engine = Engine(_model(), max_batch=max_batch, max_tokens_per_step=max_batch + extra_budget,
                    page_size=page_size,
                    kv_pages=None if spare_pages is None else longest + spare_pages)
    prompts = [_prompts()[i] for i in order]
    results = _run(engine, [(d, list(p), GREEDY) for d, p in zip(delays, prompts)])
    for prompt, events in zip(prompts, results.values()):
        assert _tokens(events) == _reference(prompt)
        assert [r for _, r in events] == [None] * (NEW - 1) + ["length"]
    assert engine.stats()["pages_used"] == 0 and not engine.has_work()


def test_a_tiny_token_budget_prefills_in_chunks_with_the_same_tokens():
    engine = Engine(_model(), max_batch=2, max_tokens_per_step=2, page_size=4)
    results = _run(engine, [(0, list(p), GREEDY) for p in _prompts()])
    for prompt, events in zip(_prompts(), results.values()):
        assert _tokens(events) == _reference(prompt)
    assert engine.stats()["pages_used"] == 0


def test_a_long_prompt_takes_one_budget_sized_chunk_per_step():
    engine = Engine(_model(), max_batch=2, max_tokens_per_step=3, page_size=4)
    engine.add_request(list(_prompts()[4]), GREEDY)  # 26 tokens
    computed = []
    for _ in range(8):
        assert engine.step() == []
        computed.append(engine.scheduler.running[0].computed)
    assert computed == [3, 6, 9, 12, 15, 18, 21, 24]
    assert len(engine.step()) == 1  # the last 2 prompt tokens, and the first new token
    assert engine.scheduler.running[0].computed == 26


def test_decoding_continues_while_a_long_prompt_prefills():
    engine = Engine(_model(), max_batch=2, max_tokens_per_step=3, page_size=4)
    short = engine.add_request(list(_prompts()[0]), GREEDY)
    engine.step()  # the 3-token prompt: prefilled, first token out
    engine.add_request(list(_prompts()[4]), GREEDY)  # 26 tokens: 13 steps of 2
    per_step = [[e.request_id for e in engine.step()] for _ in range(5)]
    assert all(short in ids for ids in per_step)  # one token every step


def test_pages_run_out_the_newest_request_pauses_and_tokens_stay_identical():
    # each is admitted with 1 or 2 pages and grows to 5: 6 pages cannot hold three at once
    engine = Engine(_model(), max_batch=3, max_tokens_per_step=8, kv_pages=6, page_size=4)
    prompts = [_prompts()[i] for i in (0, 5, 2)]
    params = SamplingParams(14, temperature=0)
    results = _run(engine, [(0, list(p), params) for p in prompts])
    for prompt, events in zip(prompts, results.values()):
        assert _tokens(events) == _reference(prompt, 14)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["pages_used"] == 0


@pytest.mark.parametrize("caching", [True, False])
def test_a_shared_three_page_prefix_is_reused_with_the_same_tokens(caching):
    rng = random.Random(1)
    prefix = [rng.randrange(V) for _ in range(12)]  # 3 pages of 4
    prompts = [prefix + [rng.randrange(V) for _ in range(n)] for n in (2, 5)]
    engine = Engine(_model(), max_batch=2, page_size=4, prefix_caching=caching)
    first = _run(engine, [(0, prompts[0], GREEDY)])
    assert engine.stats()["prefix_hits"] == 0
    second = _run(engine, [(0, prompts[1], GREEDY)])
    assert engine.stats()["prefix_hits"] == (3 if caching else 0)
    assert _tokens(next(iter(first.values()))) == _reference(tuple(prompts[0]))
    assert _tokens(next(iter(second.values()))) == _reference(tuple(prompts[1]))
    assert engine.stats()["pages_used"] == 0


def test_running_requests_share_prefix_pages_by_reference_count():
    prefix = list(range(8))
    engine = Engine(_model(), max_batch=2, page_size=4)
    a = engine.add_request([*prefix, 9], SamplingParams(4, temperature=0))
    engine.step()
    b = engine.add_request([*prefix, 10, 11], SamplingParams(4, temperature=0))
    engine.step()
    ra, rb = engine.scheduler.running
    assert ra.table[:2] == rb.table[:2] and ra.table[2] != rb.table[2]
    assert [engine.pool.refcount[p] for p in ra.table[:2]] == [2, 2]
    assert engine.stats()["prefix_hits"] == 2
    engine.abort(a)
    engine.abort(b)
    engine.step()
    assert engine.stats()["pages_used"] == 0


def test_a_prompt_made_of_cached_pages_still_runs_its_last_token():
    prompt = list(range(8))  # exactly two pages
    engine = Engine(_model(), page_size=4)
    _run(engine, [(0, prompt, GREEDY)])
    again = _run(engine, [(0, prompt, GREEDY)])
    assert engine.stats()["prefix_hits"] == 1  # page 2 holds the last token: run again
    assert _tokens(next(iter(again.values()))) == _reference(tuple(prompt))


def test_a_stop_token_ends_the_request_like_generate_eos():
    prompt = _prompts()[1]
    stop = _reference(prompt)[2]
    engine = Engine(_model())
    events = next(iter(_run(engine, [(0, list(prompt), SamplingParams(
        NEW, temperature=0, stop_token_ids=(stop,)))]).values()))
    expected = _reference(prompt, eos_token_id=stop)
    assert _tokens(events) == expected and expected[-1] == stop
    assert events[-1][1] == "stop" and len(events) < NEW


@pytest.mark.parametrize("knobs", [dict(temperature=0.8), dict(temperature=1.3, top_k=5),
                                   dict(temperature=1.0, top_p=0.7)])
def test_seeded_sampling_equals_generate_and_ignores_the_batch(knobs):
    prompt = _prompts()[3]
    params = SamplingParams(NEW, seed=1234, **knobs)
    alone = next(iter(_run(Engine(_model()), [(0, list(prompt), params)]).values()))
    others = [(0, list(p), SamplingParams(NEW, temperature=0.9, seed=i))
              for i, p in enumerate(_prompts()[:3])]
    crowded = _run(Engine(_model(), max_batch=4), [*others, (1, list(prompt), params)])
    assert _tokens(alone) == _tokens(list(crowded.values())[-1])
    hf_knobs = {"top_k": knobs.get("top_k"), "top_p": knobs.get("top_p")}
    assert _tokens(alone) == _reference(prompt, do_sample=True, seed=1234,
                                        temperature=knobs["temperature"], **hf_knobs)


def test_different_seeds_draw_different_tokens():
    prompt = list(_prompts()[1])
    runs = [_tokens(next(iter(_run(Engine(_model()), [(0, prompt, SamplingParams(
        12, temperature=2.0, seed=s))]).values()))) for s in (1, 2)]
    assert runs[0] != runs[1]


def _styled(style: str) -> DecoderLM:
    torch.manual_seed(0)
    small = dict(d_model=64, num_layers=2, num_heads=4, max_len=48, initializer_range=0.3)
    if style == "gpt":
        return DecoderLM(DecoderLMConfig.gpt(V, **small)).eval()
    if style == "sliding-qknorm":
        return DecoderLM(DecoderLMConfig.llama(V, sliding_window=6, qk_norm=True,
                                               **small)).eval()
    model = DecoderLM(DecoderLMConfig.llama(V, d_ff=128, **small)).eval()
    return model.quantize(style, 32 if style == "int4" else None)


@pytest.mark.parametrize("style", ["gpt", "sliding-qknorm", "int8", "int4"])
def test_other_families_and_quantized_models_serve_the_same_greedy_tokens(style):
    model = _styled(style)
    engine = Engine(model, max_batch=3, max_tokens_per_step=7, page_size=4)
    prompts = [list(p) for p in _prompts()]
    results = _run(engine, [(i % 3, p, GREEDY) for i, p in enumerate(prompts)])
    for prompt, events in zip(prompts, results.values()):
        expected = generate(model, torch.tensor([prompt]), NEW)[0, len(prompt):].tolist()
        assert _tokens(events) == expected
    assert engine.stats()["pages_used"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_on_the_gpu_serves_the_same_greedy_tokens_as_generate_there():
    model = _styled("gpt").cuda()
    engine = Engine(model, max_batch=3, page_size=4)
    assert engine.runner.k[0].device.type == "cuda"
    prompts = [list(p) for p in _prompts()]
    results = _run(engine, [(0, p, GREEDY) for p in prompts])
    for prompt, events in zip(prompts, results.values()):
        expected = generate(model, torch.tensor([prompt], device="cuda"), NEW)
        assert _tokens(events) == expected[0, len(prompt):].tolist()


@pytest.mark.parametrize("hooked", [False, True])
def test_decode_rows_are_not_padded_to_a_prefill_chunk(monkeypatch, hooked):
    """One forward of the step's 20 tokens (2 decode + an 18-token chunk, within the
    decoding kernels' rows), with or without a hook on the attention pattern (which sees
    each request's scores). The tokens are generate's either way."""
    model = copy.deepcopy(_model())  # the cached one stays without hooks
    if hooked:
        model.layers[0].self_attn.pattern.register_forward_hook(lambda *args: None)
    engine = Engine(model, max_batch=3, max_tokens_per_step=20, page_size=4)
    prompts = [_prompts()[0], _prompts()[1], _prompts()[4]]  # 3, 17 and 26 tokens
    ids = [engine.add_request(list(p), GREEDY) for p in prompts[:2]]
    events = engine.step()  # both prefilled
    ids.append(engine.add_request(list(prompts[2]), GREEDY))
    shapes, real = [], model.embed_tokens.forward
    monkeypatch.setattr(model.embed_tokens, "forward",
                        lambda x: shapes.append(tuple(x.shape)) or real(x))
    events += engine.step()
    assert shapes == [(1, 20)]
    while engine.has_work():
        events += engine.step()
    for request_id, prompt in zip(ids, prompts):
        assert [e.token_id for e in events if e.request_id == request_id] == _reference(prompt)


def test_one_lm_head_call_a_step_for_the_requests_that_need_a_token(monkeypatch):
    """A prefill chunk that does not end its prompt needs no logits; the rows that do (decode
    tokens, last chunks) share one ``lm_head`` call: the tokens are the same."""
    model = _model()
    engine = Engine(model, max_batch=3, max_tokens_per_step=20, page_size=4)
    prompts = [_prompts()[0], _prompts()[1], _prompts()[4]]  # 3, 17 and 26 tokens
    rows, real = [], model.lm_head.forward
    monkeypatch.setattr(model.lm_head, "forward",
                        lambda x: rows.append(tuple(x.shape)) or real(x))
    results = _run(engine, [(0, list(p), GREEDY) for p in prompts])
    # the 20 tokens shortest first above a floor of 1. Step 1: the 3-token prompt whole, 16 of
    # the 17-token one, 1 of the long one (no logits); 2: one decode, the 17-token prompt's
    # last token, 18 of the long one; 3: two decodes + its last 7 tokens; then three decodes
    assert rows[:3] == [(1, 32), (2, 32), (3, 32)]
    assert all(shape == (3, 32) for shape in rows[3:NEW - 1])
    for prompt, events in zip(prompts, results.values()):
        assert _tokens(events) == _reference(prompt)


@pytest.mark.parametrize("style", ["llama", "gpt"])
def test_a_step_may_pack_more_tokens_than_the_models_max_len(style):
    """A step's rows are packed into one sequence, each at its own positions: 3 prompts of 12-14
    tokens in one 64-token step (40 tokens) on a model of max_len 16 give generate's tokens."""
    torch.manual_seed(0)
    make = DecoderLMConfig.gpt if style == "gpt" else DecoderLMConfig.llama
    model = DecoderLM(make(V, d_model=32, num_layers=2, num_heads=4, max_len=16,
                           initializer_range=0.3)).eval()
    engine = Engine(model, max_batch=3, max_tokens_per_step=64, page_size=4)
    prompts = [list(range(1, 13)), [7] * 14, list(range(30, 43))]
    results = _run(engine, [(0, p, SamplingParams(2, temperature=0)) for p in prompts])
    for prompt, events in zip(prompts, results.values()):
        expected = generate(model, torch.tensor([prompt]), 2)[0, len(prompt):].tolist()
        assert _tokens(events) == expected
