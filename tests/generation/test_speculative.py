"""Speculative decoding is lossless: greedy tokens equal plain decoding's for every proposer
and family, sampled tokens follow the target's distribution (and a wrong acceptor is caught
by the same test), the end conditions act token by token, bad arguments are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.generation import (
    PromptLookup,
    SpeculativeStats,
    accept_sampled,
    early_exit,
    generate,
    speculative,
)
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.models.families import FAMILIES, family_for
from distribution_checks import chi_square_p, exact_distribution

V = 48
SIZES = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 64, "initializer_range": 0.2}
# Each family's own parts (as in tests/kernels/test_fused_layers.py): a sliding window shorter
# than the sequence (mistral, phi3), partial RoPE (phi3), llama3 RoPE scaling (llama).
EXTRA = {
    "llama": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "mistral": {"sliding_window": 6},
    "phi3": {"partial_rotary_factor": 0.5, "sliding_window": 7},
}
MODEL_TYPES = sorted({f.model_types[0] for f in FAMILIES.values()})


def family_model(model_type: str, seed: int = 0, **overrides: object) -> DecoderLM:
    torch.manual_seed(seed)
    config = family_for(model_type).config_from_hf(
        {"model_type": model_type, **SIZES, **EXTRA.get(model_type, {}), **overrides})
    return DecoderLM(config).eval()


_MODELS: dict[str, tuple[DecoderLM, DecoderLM]] = {}


def models_of(model_type: str) -> tuple[DecoderLM, DecoderLM]:
    """The family's target (3 layers) and a 1-layer draft of another seed, made once."""
    if model_type not in _MODELS:
        _MODELS[model_type] = (family_model(model_type),
                               family_model(model_type, seed=1, num_hidden_layers=1))
    return _MODELS[model_type]


def speculative_args(proposer: str, k: int, draft: DecoderLM) -> dict:
    return {"ngram": {"prompt_lookup_num_tokens": k},
            "draft": {"assistant_model": draft},
            "self": {"assistant_early_exit": 1 + k % 2}}[proposer]


# Prompts over a few ids repeat themselves, so that prompt lookup finds matches.
prompts = st.lists(st.integers(0, 5), min_size=1, max_size=12)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("proposer", ["ngram", "draft", "self"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=prompts, new=st.integers(0, 20), k=st.integers(1, 6))
def test_greedy_tokens_equal_plain_decoding(model_type, proposer, prompt, new, k) -> None:
    model, draft = models_of(model_type)
    ids = torch.tensor([prompt]) * 7 % V
    plain = generate(model, ids, new)
    stats = SpeculativeStats()
    fast = generate(model, ids, new, speculative_stats=stats,
                    **speculative_args(proposer, k, draft))
    assert torch.equal(fast, plain), (fast.tolist(), plain.tolist())
    assert stats.new_tokens == new and stats.accepted <= stats.proposed


def test_drafts_are_accepted_and_passes_saved() -> None:
    """On a prompt that the model continues by repeating it, prompt lookup yields several
    tokens per pass (the point of the exercise), the output still plain decoding's."""
    model, _ = models_of("llama")
    ids = torch.tensor([[3, 9, 4, 11, 5]])
    plain = generate(model, ids, 30)
    stats = SpeculativeStats()
    fast = generate(model, plain[:, :20], 15, prompt_lookup_num_tokens=8,
                    speculative_stats=stats)
    assert torch.equal(fast, generate(model, plain[:, :20], 15))
    assert stats.accepted > 0 and stats.passes < 14 and stats.tokens_per_pass > 1


@pytest.mark.parametrize("proposer", ["ngram", "draft", "self"])
def test_keys_that_go_stale_are_computed_again_as_in_plain_decoding(proposer) -> None:
    """Phi-3's longrope turns to its long factors at 16 positions: no pass of drafts runs
    across that length, and the whole sequence is computed again there, as plain decoding
    does, so the tokens stay plain decoding's."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5], "long_factor": [3.0, 4.0]}
    model = family_model("phi3", original_max_position_embeddings=16, rope_parameters=rope)
    assert model.cache_expires(16)
    _, draft = models_of("phi3")
    for prompt in ([1, 2, 3, 1, 2, 3], [4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5]):
        ids = torch.tensor([prompt])
        assert torch.equal(generate(model, ids, 20, **speculative_args(proposer, 5, draft)),
                           generate(model, ids, 20))


class Letters:
    """A decoder for stop strings: token i is the letter chr(97 + i % 26)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


class Recorder:
    """A streamer that records the tokens it is given, then "end"."""

    def __init__(self) -> None:
        self.seen: list[int | str] = []

    def put(self, token: torch.Tensor) -> None:
        self.seen.append(int(token[0]))

    def end(self) -> None:
        self.seen.append("end")


@pytest.mark.parametrize("proposer", ["ngram", "draft", "self"])
def test_end_conditions_and_processors_act_as_in_plain_decoding(proposer) -> None:
    """End ids and stop strings inside an accepted run of drafts end the row at that token;
    the repetition penalty sees each draft's own prefix; the streamer gets every token."""
    model, draft = models_of("qwen2")
    ids = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    plain = generate(model, ids, 24)
    new = plain[0, ids.shape[1]:].tolist()
    cases = [{"eos_token_id": new[9]}, {"stop_strings": Letters().decode(new[6:8]),
                                        "tokenizer": Letters()},
             {"repetition_penalty": 1.5}, {"repetition_penalty": 0.7, "eos_token_id": [0, 1]}]
    for case in cases:
        streamer = Recorder()
        expected = generate(model, ids, 24, **case)
        got = generate(model, ids, 24, streamer=streamer, **case,
                       **speculative_args(proposer, 4, draft))
        assert torch.equal(got, expected), case
        assert streamer.seen == [*got[0, ids.shape[1]:].tolist(), "end"]


def test_prompt_lookup_proposes_what_followed_the_longest_recent_match() -> None:
    lookup = PromptLookup(3, max_ngram=3)

    def propose(seq: list[int], k: int = 3) -> list[int]:
        return lookup.propose(torch.tensor([seq]), k, None)[0].tolist()

    assert propose([7, 1, 2, 5, 6, 8, 1, 2, 9, 4, 0, 1, 2]) == [9, 4, 0]  # latest "1 2"
    assert propose([1, 2, 3, 4, 5, 9, 2, 3, 6, 1, 2, 3]) == [4, 5, 9]  # "1 2 3" beats "2 3"
    assert propose([1, 2, 3, 4, 5, 9, 2, 3, 6, 1, 2, 3], k=2) == [4, 5]
    assert propose([5, 6, 7, 8]) == []  # no earlier occurrence
    assert propose([4, 4, 4, 4, 4, 4]) == [4, 4, 4]  # a loop: the latest match with 3 after it


def test_prompt_lookup_adapts_and_switches_itself_off_and_on() -> None:
    """All accepted: k + 2 (capped); some rejected: k = the number accepted, 0 = off; while
    off it guesses unverified and turns on (k = 2) once a guess was the model's next token."""
    lookup = PromptLookup(6, max_ngram=2)
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert lookup.propose(torch.tensor([seq]), 6, None)[0].tolist() == [3, 4, 5, 6, 7, 8]
    lookup.feedback(6, 3)
    assert lookup.k == 3
    lookup.feedback(3, 3)
    assert lookup.k == 5
    lookup.feedback(5, 0)
    assert lookup.k == 0
    assert lookup.propose(torch.tensor([seq]), 6, None)[0].tolist() == []  # off: guess 3
    assert lookup.propose(torch.tensor([[*seq, 9]]), 6, None)[0].tolist() == []  # wrong: off
    assert lookup.propose(torch.tensor([[*seq, 9, 1, 2]]), 6, None)[0].tolist() == []
    assert lookup.propose(torch.tensor([[*seq, 9, 1, 2, 3]]), 6, None)[0].tolist() == [4, 5]


def test_early_exit_shares_weights_and_leaves_the_model_whole() -> None:
    model, _ = models_of("gemma")
    ids = torch.tensor([[1, 2, 3, 4]])
    before = model(ids)
    short = early_exit(model, 2)
    assert len(short.layers) == 2 and len(model.layers) == 3
    assert short.lm_head.weight is model.lm_head.weight and short.config.num_layers == 2
    assert len(short.make_cache(1, 8)) == 2
    assert torch.equal(model(ids), before)
    with torch.no_grad():  # the draft is embedding -> 2 blocks -> final norm -> head
        x = model.embed_tokens(ids) * torch.tensor(model.config.embedding_scale)
        rotary = model.rotary(torch.arange(4))
        for layer in model.layers[:2]:
            x = layer(x, rotary=rotary, is_causal=True)
        assert torch.allclose(short(ids), model.lm_head(model.norm(x)), atol=1e-5)


# --- sampling: the distribution of the tokens is the target's -----------------------------

# 3^3 = 27 sequences of new tokens: the prefill makes the first, one pass the other two (a
# draft, accepted or not, and the token after it).
SMALL_V, NEW = 3, 3


def peaked(seed: int, layers: int) -> DecoderLM:
    """A tiny model whose next-token distributions are far from uniform (weights N(0, 1))."""
    torch.manual_seed(seed)
    model = DecoderLM(DecoderLMConfig.llama(SMALL_V, d_model=16, num_layers=layers,
                                            num_heads=2, max_len=16)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.6)
    return model






def sampled_counts(target, draft, prompt, samples: int) -> torch.Tensor:
    counts = torch.zeros(SMALL_V ** NEW)
    weights = SMALL_V ** torch.arange(NEW - 1, -1, -1)
    for seed in range(samples):
        out = generate(target, torch.tensor([prompt]), NEW, do_sample=True, seed=seed,
                       assistant_model=draft)
        counts[int((out[0, len(prompt):] * weights).sum())] += 1
    return counts


def resample_from_p(p, q, drafts, generator=None):
    """A wrong acceptor: on a rejection it draws from p, not from norm(max(0, p - q))."""
    n = drafts.shape[0]
    for i in range(n):
        d = int(drafts[i])
        if torch.rand((), generator=generator) * q[i, d] >= p[i, d]:
            return torch.cat([drafts[:i], torch.multinomial(p[i], 1, generator=generator)])
    return torch.cat([drafts, torch.multinomial(p[n], 1, generator=generator)])


def test_sampled_tokens_follow_the_target_distribution_and_a_wrong_acceptor_fails(
        monkeypatch) -> None:
    target, draft = peaked(0, 2), peaked(5, 1)
    prompt, samples = [0, 2, 1], 1000
    probs = exact_distribution(target, prompt, SMALL_V, NEW)
    assert abs(float(probs.sum()) - 1) < 1e-5
    assert chi_square_p(sampled_counts(target, draft, prompt, samples), probs) > 1e-3
    monkeypatch.setattr(speculative, "accept_sampled", resample_from_p)
    assert chi_square_p(sampled_counts(target, draft, prompt, samples), probs) < 1e-6


@pytest.mark.parametrize("with_q", [True, False])
def test_acceptance_rule_gives_p_for_any_q(with_q: bool) -> None:
    """The rule alone, one draft from q (or a fixed one, q one-hot): the first token of the
    output follows p, and a rule that keeps every draft would not."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    counts = torch.zeros(4)
    for _ in range(8000):
        d = torch.multinomial(q[0], 1, generator=g) if with_q else torch.tensor([3])
        counts[int(accept_sampled(p, q if with_q else None, d, g)[0])] += 1
    assert chi_square_p(counts, p[0]) > 1e-3
    assert chi_square_p(counts, q[0] if with_q else torch.tensor([0., 0., 0., 1.])) < 1e-6


# --- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"input_ids": torch.tensor([[1, 2], [3, 4]]), "prompt_lookup_num_tokens": 3},
     r"prompt_lookup_num_tokens: speculative decoding takes a batch of 1 row .* got 2 rows"),
    ({"attention_mask": torch.tensor([[0, 1, 1]]), "assistant_early_exit": 1},
     r"attention_mask: speculative decoding \(assistant_early_exit\) takes a prompt without "
     r"padding"),
    ({"use_cache": False, "prompt_lookup_num_tokens": 3}, r"use_cache: .*use_cache=False"),
    ({"prompt_lookup_num_tokens": 3, "assistant_early_exit": 1},
     r"prompt_lookup_num_tokens, assistant_early_exit: expected one way of proposing"),
    ({"max_matching_ngram_size": 2}, r"max_matching_ngram_size: only used with "
                                     r"prompt_lookup_num_tokens"),
    ({"prompt_lookup_num_tokens": 0}, r"prompt_lookup_num_tokens: .*got 0"),
    ({"assistant_early_exit": 3}, r"assistant_early_exit: expected fewer layers than the "
                                  r"model's 3, got 3"),
    ({"speculative_stats": SpeculativeStats()}, r"speculative_stats: counts speculative"),
])
def test_bad_arguments_are_refused_by_name(kwargs: dict, message: str) -> None:
    model, _ = models_of("llama")
    kwargs = {"input_ids": torch.tensor([[1, 2, 3]]), **kwargs}
    with pytest.raises((ValueError, TypeError), match=message):
        generate(model, max_new_tokens=4, **kwargs)


def test_a_draft_with_another_vocabulary_or_too_few_positions_is_refused() -> None:
    model, _ = models_of("llama")
    other = DecoderLM(DecoderLMConfig.llama(V + 1, d_model=16, num_layers=1, num_heads=2))
    with pytest.raises(ValueError, match=rf"assistant_model: expected the target's vocabulary "
                                         rf"of {V} tokens .* got vocab_size={V + 1}"):
        generate(model, torch.tensor([[1, 2]]), 4, assistant_model=other)
    short = DecoderLM(DecoderLMConfig.llama(V, d_model=16, num_layers=1, num_heads=2,
                                            max_len=8))
    with pytest.raises(ValueError, match=r"assistant_model: the generation needs 12 positions, "
                                         r"more than the draft's limit of 8"):
        generate(model, torch.tensor([[1, 2]]), 10, assistant_model=short)
    with pytest.raises(TypeError, match=r"assistant_model: expected a causal LM"):
        generate(model, torch.tensor([[1, 2]]), 4, assistant_model=object())
