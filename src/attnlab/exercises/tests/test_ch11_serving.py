"""Checks of tutorial 11's exercises (``attnlab exercises check 11``)."""

import torch

from attnlab.exercises.checks import assert_equal, learner
from attnlab.generation import generate
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.serving import Engine, ModelRunner, SamplingParams, page_hashes


def chapter():
    return learner(__file__)


def tiny_model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(100, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                   max_len=128, initializer_range=0.2, tie_embeddings=False)
    return DecoderLM(config).eval()


def test_11_1_pages_and_bytes():
    for layers, kv_heads, head_dim, page in [(24, 2, 64, 16), (2, 1, 8, 4)]:
        config = DecoderLMConfig.llama(10, d_model=kv_heads * head_dim, num_layers=layers,
                                       num_heads=kv_heads, num_kv_heads=kv_heads, max_len=page)
        runner = ModelRunner(DecoderLM(config).to(torch.bfloat16).eval(), 4, page)
        measured = runner.nbytes // 4
        pages, page_bytes = chapter().pages_and_bytes(1200, page, layers, kv_heads, head_dim, 2)
        assert_equal(page_bytes, measured, name=f"the bytes of a page ({layers} layers, G="
                     f"{kv_heads}, D={head_dim}, page {page}) against a ModelRunner's")
        assert_equal(pages, -(-1200 // page), name=f"the pages of 1200 tokens (page {page})")


def expected_tokens(model, prompts, max_tokens):
    return {k: generate(model, torch.tensor([p]), max_tokens)[0, len(p):].tolist()
            for k, p in prompts.items()}


def test_11_2_drain_gives_every_request_its_own_tokens():
    model = tiny_model()
    prompts = {"x": [1, 2, 3, 4, 5], "y": list(range(50, 61)), "z": [9, 9]}
    expected = expected_tokens(model, prompts, 4)
    for order, per_step in [("xyz", None), ("zyx", 1)]:
        engine = Engine(model, max_batch=2, max_tokens_per_step=8, kv_pages=24, page_size=4)
        got = chapter().drain(engine, {k: prompts[k] for k in order}, 4, per_step)
        for k in order:
            assert_equal(got.get(k), expected[k],
                         name=f"request {k}'s tokens, order {order}, per_step={per_step}")


def test_11_3_runs_out_of_pages():
    assert_equal(chapter().runs_out_of_pages([6, 6, 6], 8, 4, 8), True,
                 name="runs_out_of_pages([6, 6, 6], 8 new, page 4, 8 pages)")
    assert_equal(chapter().runs_out_of_pages([6, 6, 6], 8, 4, 12), False,
                 name="runs_out_of_pages([6, 6, 6], 8 new, page 4, 12 pages)")
    assert_equal(chapter().runs_out_of_pages([3], 1, 4, 1), False,
                 name="runs_out_of_pages([3], 1 new, page 4, 1 page)")
    model = tiny_model()
    prompts = {f"q{i}": list(range(20 * i, 20 * i + 6)) for i in range(3)}
    engine = Engine(model, max_batch=3, max_tokens_per_step=32, kv_pages=8, page_size=4)
    got = {k: [] for k in prompts}
    for k, prompt in prompts.items():
        engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0), request_id=k)
    while engine.has_work():
        for event in engine.step():
            got[event.request_id].append(event.token_id)
    assert engine.stats()["preemptions"] > 0, "the engine of 8 pages should have preempted"
    assert got == expected_tokens(model, prompts, 8), "preempted requests must still be right"


def test_11_4_chain_hashes():
    for tokens, page in [([1, 2, 3, 4, 5, 6, 7, 8], 4), (list(range(-3, 14)), 5), ([7], 4)]:
        assert_equal(chapter().chain_hashes(tokens, page), page_hashes(tokens, page),
                     name=f"chain_hashes({tokens}, {page}) against page_hashes")
    one, two = chapter().chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), \
        chapter().chain_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert one[1] != two[1], "the same second page after different first pages: other hashes"


def test_11_5_check_step_budget():
    chapter().check_step_budget(8, 8)
    try:
        chapter().check_step_budget(8, 4)
    except ValueError as error:
        assert "max_tokens_per_step" in str(error), f"name max_tokens_per_step: {error!r}"
    else:
        raise AssertionError("check_step_budget(8, 4) should raise ValueError")
    try:
        Engine(tiny_model(), max_batch=8, max_tokens_per_step=4)
    except ValueError:
        pass
    else:
        raise AssertionError("the library's Engine refuses it too")
