"""Batch invariance at any load: with the fast modules (whose rule names one batch-invariant
kernel for up to ``DECODING_ROWS`` rows), a greedy request's tokens and logits do not
depend on the other requests' prompts and decodes that share its steps."""

from __future__ import annotations

import copy

import pytest
import torch

from attnlab.kernels.install import optimize_for_inference
from attnlab.kernels.rule import DECODING_ROWS, batch_invariant, bucket_of, features, rule
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.serving import Engine, SamplingParams

V = 61


def _model() -> DecoderLM:
    """A tiny Llama with the fast modules, its kernels chosen by the rule."""
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(V, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                   max_len=128, initializer_range=0.3)
    return optimize_for_inference(DecoderLM(config).eval())


def _serve(model: DecoderLM, others: list[list[int]]
           ) -> tuple[list[int], list[torch.Tensor], list[int]]:
    """The target request's tokens and logits rows, served alone (``others`` empty) or with
    ``others`` arriving after its prompt is prefilled; and the tokens of every forward."""
    model = copy.deepcopy(model)
    engine = Engine(model, max_batch=8, max_tokens_per_step=64, page_size=4)
    logits, real = {}, engine._next_token
    engine._next_token = lambda request, row, *args: (
        logits.setdefault(request.request_id, []).append(row.clone())
        or real(request, row, *args))
    forwards, embed = [], model.embed_tokens.forward
    model.embed_tokens.forward = lambda ids: forwards.append(ids.shape[1]) or embed(ids)
    target = engine.add_request(list(range(3, 13)), SamplingParams(12, temperature=0))
    events = engine.step()  # the target's prompt, alone in both runs
    for prompt in others:
        engine.add_request(prompt, SamplingParams(12, temperature=0))
    while engine.has_work():
        events += engine.step()
    tokens = [e.token_id for e in events if e.request_id == target]
    return tokens, logits[target], forwards


@pytest.mark.usefixtures("native_kernels")
def test_a_greedy_request_gives_the_same_tokens_and_logits_alone_and_beside_others(
        monkeypatch, tmp_path):
    # the rule's kernels, not the session's pin to the formula (conftest)
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    plan = {b: rule("float32", torch.float32, features())[b][0] for b in ("1", "2-8", "9-32")}
    if not batch_invariant(plan):
        pytest.skip(f"this machine's rule names no batch-invariant float32 kernel ({plan})")
    model = _model()
    alone, alone_logits, _ = _serve(model, [])
    # two long prompts prefill in chunks beside the target's decode steps; four short ones
    # decode with it
    others = [[(7 * i + j) % V for j in range(n)] for i, n in enumerate((40, 45, 3, 4, 2, 5))]
    crowded, crowded_logits, forwards = _serve(model, others)
    assert crowded == alone and len(alone) == 12
    assert len(crowded_logits) == len(alone_logits)
    for i, (a, b) in enumerate(zip(alone_logits, crowded_logits)):
        assert torch.equal(a, b), f"token {i}: max |alone - crowded| = {(a - b).abs().max()}"
    # the crowded run had steps past the decoding kernels' rows, run as several forwards
    assert max(forwards) > DECODING_ROWS and bucket_of(max(forwards)) == "33+"
    assert any(1 < n <= DECODING_ROWS for n in forwards)
