"""The engine's per-request controls (``attnlab.serving.request_logits``) against
``attnlab.generation.generate`` one request at a time: penalties, bias, min-p and logprobs, each
request with its own settings inside one batch."""

from __future__ import annotations

import functools
import math
import random

import pytest
import torch

from attnlab.generation import generate
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.serving import Engine, SamplingParams
from conftest import assert_close

V = 61
NEW = 8
LENGTHS = (3, 17, 9, 26)


@functools.cache
def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4, max_len=64,
                                   initializer_range=0.3)
    return DecoderLM(config).eval()


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(V) for _ in range(n)] for n in LENGTHS]


# (SamplingParams fields, the same as generate's arguments)
CONTROLS = [
    ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    ({"presence_penalty": 1.5, "frequency_penalty": 0.7},
     {"presence_penalty": 1.5, "frequency_penalty": 0.7}),
    ({"logit_bias": {5: 8.0, 7: -100.0}}, {"logit_bias": {5: 8.0, 7: -100.0}}),
    ({}, {}),
]


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    """Add every request at once, step until done: each request's events."""
    ids = [engine.add_request(p, s) for p, s in requests]
    out: dict[str, list] = {i: [] for i in ids}
    for _ in range(1000):
        if not engine.has_work():
            break
        for event in engine.step():
            out[event.request_id].append(event)
    return [out[i] for i in ids]


def test_each_request_its_controls_in_one_batch_equal_generate_alone() -> None:
    """Four requests, each with other controls, batched with a small token budget (chunked
    prefills beside decodes): each one's greedy tokens are generate's alone."""
    model, prompts = _model(), _prompts()
    engine = Engine(model, max_batch=4, max_tokens_per_step=8, page_size=4)
    requests = [(p, SamplingParams(NEW, temperature=0, **ours))
                for p, (ours, _) in zip(prompts, CONTROLS)]
    results = _run(engine, requests)
    for prompt, (_, theirs), events in zip(prompts, CONTROLS, results):
        expected = generate(model, torch.tensor([prompt]), NEW, **theirs)[0, len(prompt):]
        assert [e.token_id for e in events] == expected.tolist()
    assert engine.pool.used == 0 and not engine._controls


def test_logit_bias_of_100_forces_its_token() -> None:
    engine = Engine(_model(), max_batch=2)
    [events] = _run(engine, [([1, 2, 3], SamplingParams(5, logit_bias={11: 100.0}, seed=0))])
    assert [e.token_id for e in events] == [11] * 5


def test_min_p_one_keeps_the_most_likely_token_only() -> None:
    """min_p = 1 keeps only the tokens as likely as the most likely: sampling at temperature
    1 then gives the greedy tokens."""
    engine = Engine(_model(), max_batch=4)
    prompts = _prompts()
    sampled = _run(engine, [(p, SamplingParams(NEW, min_p=1.0, seed=i))
                            for i, p in enumerate(prompts)])
    greedy = _run(engine, [(p, SamplingParams(NEW, temperature=0)) for p in prompts])
    assert [[e.token_id for e in s] for s in sampled] == \
        [[e.token_id for e in g] for g in greedy]


@pytest.mark.parametrize("k", [0, 3])
def test_logprobs_and_prompt_logprobs_equal_generate(k) -> None:
    """Batched, with a penalty that changes the tokens but not the logprobs (the model's
    log-softmax before any processor): the values of generate(logprobs=k,
    prompt_logprobs=True), request by request."""
    model, prompts = _model(), _prompts()
    engine = Engine(model, max_batch=4, max_tokens_per_step=8, page_size=4)
    params = SamplingParams(NEW, temperature=0, logprobs=k, prompt_logprobs=True,
                            repetition_penalty=1.3)
    # a first request with the same prompt fills the prefix cache, which these must not use
    _run(engine, [(prompts[1], SamplingParams(2, temperature=0))])
    results = _run(engine, [(p, params) for p in prompts])
    for prompt, events in zip(prompts, results):
        out = generate(model, torch.tensor([prompt]), NEW, logprobs=k, prompt_logprobs=True,
                       repetition_penalty=1.3)
        assert [e.token_id for e in events] == out.sequences[0, len(prompt):].tolist()
        got = torch.tensor([e.logprobs.logprob for e in events])
        assert_close(got, out.logprobs[0].float())
        if k:
            assert [list(e.logprobs.top_ids) for e in events] == out.top_ids[0].tolist()
            assert_close(torch.tensor([e.logprobs.top_logprobs for e in events]),
                         out.top_logprobs[0].float())
        prompt_entries = events[0].prompt_logprobs
        assert len(prompt_entries) == len(prompt) and math.isnan(prompt_entries[0].logprob)
        assert all(e.prompt_logprobs is None for e in events[1:])
        assert_close(torch.tensor([e.logprob for e in prompt_entries[1:]]),
                     out.prompt_logprobs[0, 1:].float())


def test_bad_controls_name_their_field() -> None:
    engine = Engine(_model(), max_batch=2)
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request([1], SamplingParams(2, logit_bias={V: 1.0}))
    with pytest.raises(ValueError, match="json_schema: the engine was made without a "
                                         "tokenizer"):
        engine.add_request([1], SamplingParams(2, json_schema={"type": "object"},
                                               stop_token_ids=(0,)))
    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3),
                         ("repetition_penalty", 0), ("min_p", 1.5), ("logprobs", 21),
                         ("logit_bias", {1: 101})]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(2, **{field: value})
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(2, prompt_logprobs=True)
