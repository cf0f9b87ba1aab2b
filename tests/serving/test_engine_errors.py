"""The engine under aborts, failures, overload and hostile input: every page comes back,
every bad argument is refused by name before anything is queued."""

from __future__ import annotations

import threading

import pytest
import torch

from attnlab.generation import generate
from attnlab.layers.rope_scaling import RopeScaling
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.serving import Engine, QueueFull, SamplingParams

V = 37
GREEDY = SamplingParams(5, temperature=0)


def _model(**overrides) -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(V, d_model=16, num_layers=1, num_heads=2, max_len=32,
                                   initializer_range=0.3, **overrides)
    return DecoderLM(config).eval()


def _drain(engine: Engine) -> list:
    events = []
    for _ in range(200):
        if not engine.has_work():
            return events
        events += engine.step()
    raise AssertionError("the engine made no progress")


def test_an_idle_engine_has_no_work_and_steps_to_nothing():
    engine = Engine(_model())
    assert not engine.has_work() and engine.step() == []
    assert engine.stats() == {"running": 0, "waiting": 0, "pages_used": 0,
                              "pages_total": engine.pool.num_pages, "pages_cached": 0,
                              "prefix_hits": 0, "tokens_generated": 0, "preemptions": 0,
                              "spec_verifications": 0, "spec_proposed": 0, "spec_accepted": 0,
                              "spec_switched_off": 0, "spec_acceptance_rate": 0.0,
                              "spec_tokens_per_verification": 1.0}


def test_aborts_while_waiting_prefilling_and_decoding_return_every_page():
    engine = Engine(_model(), max_batch=2, max_tokens_per_step=4, page_size=4)
    decoding = engine.add_request([1, 2], SamplingParams(20, temperature=0))
    engine.step()
    prefilling = engine.add_request(list(range(20)), GREEDY)
    waiting = engine.add_request([3], GREEDY)
    engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 1
    assert engine.stats()["pages_used"] > 0
    for request_id in (decoding, prefilling, waiting):
        engine.abort(request_id)
    engine.abort(waiting)  # twice: reported once
    events = engine.step()
    assert sorted((e.request_id, e.token_id, e.finish_reason) for e in events) == sorted(
        (i, None, "abort") for i in (decoding, prefilling, waiting))
    assert engine.stats()["pages_used"] == 0 and not engine.has_work()


def test_aborting_an_unknown_or_finished_request_is_ignored():
    engine = Engine(_model())
    done = engine.add_request([1], SamplingParams(1, temperature=0))
    _drain(engine)
    engine.abort(done)
    engine.abort("never-added")
    assert engine.step() == [] and not engine.has_work()
    with pytest.raises(TypeError, match="request_id: expected a str, got int"):
        engine.abort(3)


def test_a_failing_forward_ends_the_step_requests_and_the_engine_serves_on(monkeypatch):
    model = _model()
    engine = Engine(model, max_batch=2, page_size=4)
    ids = [engine.add_request(list(range(1, 9)), GREEDY) for _ in range(2)]
    engine.step()
    mlp = model.layers[0].mlp
    monkeypatch.setattr(mlp, "forward", lambda x: (_ for _ in ()).throw(RuntimeError("boom")))
    events = engine.step()
    assert {(e.request_id, e.finish_reason, e.error) for e in events} == {
        (i, "abort", "RuntimeError: boom") for i in ids}
    assert engine.stats()["pages_used"] == 0 and not engine.has_work()
    monkeypatch.undo()
    again = engine.add_request([4, 5, 6], GREEDY)
    tokens = [e.token_id for e in _drain(engine) if e.request_id == again]
    assert tokens == generate(model, torch.tensor([[4, 5, 6]]), 5)[0, 3:].tolist()


def test_nan_logits_end_only_their_request(monkeypatch):
    model = _model()
    engine = Engine(model, max_batch=2)
    # one-token prompts: both rows in one forward
    bad, good = (engine.add_request([7], GREEDY), engine.add_request([9], GREEDY))
    real = model.lm_head.forward

    def poisoned(x):
        out = real(x)
        out[0] = float("nan")  # row 0: the first admitted request
        return out

    monkeypatch.setattr(model.lm_head, "forward", poisoned)
    events = engine.step()
    monkeypatch.undo()
    by_id = {e.request_id: e for e in events}
    assert by_id[bad].finish_reason == "abort" and "NaN" in by_id[bad].error
    assert by_id[good].token_id is not None and by_id[good].finish_reason is None
    _drain(engine)
    assert engine.stats()["pages_used"] == 0


def test_a_full_queue_raises_queue_full_until_requests_are_admitted():
    engine = Engine(_model(), max_batch=1, max_queue=2)
    engine.add_request([1], GREEDY)
    engine.add_request([2], GREEDY)
    with pytest.raises(QueueFull, match="max_queue: 2 requests are waiting"):
        engine.add_request([3], GREEDY)
    engine.step()  # one admitted
    engine.add_request([3], GREEDY)
    assert engine.stats()["waiting"] == 2


def test_requests_longer_than_the_context_or_the_pool_are_refused_by_field():
    engine = Engine(_model(), page_size=4, kv_pages=5)  # 20 slots < max_len 32
    with pytest.raises(ValueError, match=r"max_tokens: the prompt has 10 tokens and the KV "
                                         r"cache holds 20 tokens \(5 pages of 4\), so at most "
                                         r"10 new tokens fit; got 11"):
        engine.add_request([1] * 10, SamplingParams(11))
    with pytest.raises(ValueError, match=r"prompt_ids: the prompt has 20 tokens and the KV .* "
                                         r"no room for a new token \(at most 19 prompt"):
        engine.add_request([1] * 20, SamplingParams(1))
    roomy = Engine(_model())
    with pytest.raises(ValueError, match=r"max_tokens: the prompt has 30 tokens and the model's "
                                         r"context is max_len=32 tokens, so at most 2 new "
                                         r"tokens fit; got 3"):
        roomy.add_request([1] * 30, SamplingParams(3))
    roomy.add_request([1] * 30, SamplingParams(2))  # exactly the context
    assert len(_drain(roomy)) == 2 and roomy.stats()["waiting"] == 0


@pytest.mark.parametrize(("prompt", "error", "message"), [
    ("abc", TypeError, "prompt_ids: expected a list of token ids, got str"),
    (torch.tensor([1, 2]), TypeError, "prompt_ids: expected a list of token ids, got Tensor"),
    ([], ValueError, "prompt_ids: expected at least one token id, got an empty list"),
    ([1, V], ValueError, rf"prompt_ids: expected ints in \[0, {V}\) .*got \[{V}\]"),
    ([1, -1], ValueError, r"prompt_ids: expected ints .*got \[-1\]"),
    ([1.0], ValueError, r"prompt_ids: expected ints .*got \[1.0\]"),
    ([True], ValueError, r"prompt_ids: expected ints .*got \[True\]"),
])
def test_bad_prompts_are_refused_by_name(prompt, error, message):
    engine = Engine(_model())
    with pytest.raises(error, match=message):
        engine.add_request(prompt, GREEDY)
    assert not engine.has_work()


def test_bad_params_and_ids_are_refused_by_name():
    engine = Engine(_model())
    with pytest.raises(TypeError, match="params: expected a SamplingParams, got dict"):
        engine.add_request([1], {"max_tokens": 3})
    with pytest.raises(ValueError, match=rf"stop_token_ids\[1\]: expected a token id in "
                                         rf"\[0, {V}\), got {V}"):
        engine.add_request([1], SamplingParams(3, stop_token_ids=(0, V)))
    with pytest.raises(TypeError, match="request_id: expected a non-empty str or None, got ''"):
        engine.add_request([1], GREEDY, request_id="")
    engine.add_request([1], GREEDY, request_id="a")
    with pytest.raises(ValueError, match="request_id: 'a' is running or waiting already"):
        engine.add_request([1], GREEDY, request_id="a")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_tokens", 0, "max_tokens: expected an int >= 1, got 0"),
    ("max_tokens", 2.0, "max_tokens: expected an int >= 1, got 2.0"),
    ("temperature", -0.1, "temperature: expected a finite float >= 0"),
    ("temperature", float("nan"), "temperature: expected a finite float >= 0"),
    ("temperature", "1", "temperature: expected a finite float >= 0"),
    ("top_p", 0.0, r"top_p: expected a float in \(0, 1\], got 0.0"),
    ("top_p", 1.5, r"top_p: expected a float in \(0, 1\], got 1.5"),
    ("top_k", -1, r"top_k: expected an int >= 0 \(0 = off\), got -1"),
    ("top_k", 2.5, r"top_k: expected an int >= 0"),
    ("seed", 2**64, r"seed: expected None or an int in \[-2\*\*63, 2\*\*64\)"),
    ("seed", "7", "seed: expected None or an int"),
    ("stop_token_ids", "ab", "stop_token_ids: expected a tuple of token ids"),
    ("stop_token_ids", (1, -2), "stop_token_ids: expected a tuple of token ids"),
    ("stop_token_ids", 3, "stop_token_ids: expected a tuple of token ids"),
])
def test_sampling_params_refuse_bad_fields_by_name(field, value, message):
    kwargs = {"max_tokens": 4, field: value}
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_stop_ids_and_say_greedy():
    params = SamplingParams(3, temperature=0, stop_token_ids=[1, 2])
    assert params.stop_token_ids == (1, 2) and params.greedy
    assert not SamplingParams(3).greedy


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"max_batch": 0}, ValueError, "max_batch: expected a positive int, got 0"),
    ({"page_size": 0}, ValueError, "page_size: expected a positive int, got 0"),
    ({"max_queue": -1}, ValueError, "max_queue: expected a positive int, got -1"),
    ({"kv_pages": 0}, ValueError, "kv_pages: expected a positive int, got 0"),
    ({"max_batch": 8, "max_tokens_per_step": 4}, ValueError,
     "max_tokens_per_step: expected at least max_batch=8"),
    ({"page_size": 33}, ValueError, "page_size: expected at most the model's max_len=32"),
    ({"prefix_caching": 1}, TypeError, "prefix_caching: expected a bool, got 1"),
])
def test_bad_engine_settings_are_refused_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        Engine(_model(), **kwargs)


def test_models_the_engine_cannot_serve_are_refused():
    with pytest.raises(TypeError, match="model: expected an attnlab DecoderLM, got Linear"):
        Engine(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="model: expected a model in eval mode"):
        Engine(_model().train())
    longrope = RopeScaling(rope_type="longrope", short_factor=(1.0,) * 4,
                           long_factor=(2.0,) * 4, original_max_position_embeddings=16)
    with pytest.raises(ValueError, match="model: longrope RoPE"):
        Engine(_model(rope_scaling=longrope))


def test_default_pool_holds_max_batch_contexts():
    engine = Engine(_model(), max_batch=3, page_size=4)
    assert engine.pool.num_pages == 3 * 32 // 4
    assert engine.runner.k[0].dtype == torch.float32


def test_requests_added_from_another_thread_while_stepping():
    model = _model()
    engine = Engine(model, max_batch=3, max_queue=64)
    prompts = [[i % V, (3 * i) % V, 5] for i in range(1, 13)]
    ids: list[str] = []

    def client():
        for prompt in prompts:
            ids.append(engine.add_request(prompt, GREEDY))

    thread = threading.Thread(target=client)
    thread.start()
    events = []
    while thread.is_alive() or engine.has_work():
        events += engine.step()
    thread.join()
    for request_id, prompt in zip(ids, prompts):
        tokens = [e.token_id for e in events if e.request_id == request_id]
        assert tokens == generate(model, torch.tensor([prompt]), 5)[0, 3:].tolist()
    assert engine.stats()["pages_used"] == 0


def test_an_abort_during_the_last_step_does_not_touch_a_new_request_of_that_id(monkeypatch):
    model = _model()
    engine = Engine(model)
    engine.add_request([1, 2], SamplingParams(1, temperature=0), request_id="r")
    real = model.lm_head.forward

    def disconnect_mid_forward(x):  # as the HTTP thread would, while the model runs
        engine.abort("r")
        return real(x)

    monkeypatch.setattr(model.lm_head, "forward", disconnect_mid_forward)
    assert [e.finish_reason for e in engine.step()] == ["length"]
    monkeypatch.undo()
    engine.add_request([3], GREEDY, request_id="r")  # the id, reused
    events = _drain(engine)
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"]


def test_a_second_stepping_thread_is_refused(monkeypatch):
    model = _model()
    engine = Engine(model)
    engine.add_request([1], GREEDY)
    inside, release = threading.Event(), threading.Event()
    real = model.lm_head.forward

    def slow(x):
        inside.set()
        release.wait(600)  # set by the test once the second step is refused
        return real(x)

    monkeypatch.setattr(model.lm_head, "forward", slow)
    thread = threading.Thread(target=engine.step)
    thread.start()
    try:
        assert inside.wait(600)
        with pytest.raises(RuntimeError, match="step: another thread is running step"):
            engine.step()
    finally:
        release.set()
    thread.join()
    assert engine.stats()["tokens_generated"] == 1


def test_a_failing_lm_head_ends_the_requests_it_was_for_only(monkeypatch):
    """The step's one ``lm_head`` call raising ends the requests that needed a token then; a
    request still prefilling (no logits that step) goes on, and so does the engine."""
    model = _model()
    engine = Engine(model, max_batch=2, max_tokens_per_step=6, page_size=4)
    short = engine.add_request([4, 5, 6], GREEDY)
    long = engine.add_request(list(range(1, 21)), GREEDY)  # 20 tokens: several chunks
    real = model.lm_head.forward

    def failing(x):
        raise RuntimeError("head down")

    monkeypatch.setattr(model.lm_head, "forward", failing)
    events = engine.step()  # the short prompt whole, 3 tokens of the long one
    monkeypatch.setattr(model.lm_head, "forward", real)
    assert [(e.request_id, e.finish_reason, e.error) for e in events] == [
        (short, "abort", "RuntimeError: head down")]
    tokens = [e.token_id for e in _drain(engine) if e.request_id == long]
    expected = generate(model, torch.tensor([list(range(1, 21))]), GREEDY.max_tokens)
    assert tokens == expected[0, 20:].tolist()
    assert engine.stats()["pages_used"] == 0
