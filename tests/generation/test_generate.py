"""generate() for DecoderLM against a plain greedy loop, with batches, padding, sampling."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.generation import generate
from attnlab.models import DecoderLM, DecoderLMConfig, Transformer, TransformerConfig

V = 19


def make(style: str = "llama") -> DecoderLM:
    torch.manual_seed(0)
    factory = DecoderLMConfig.llama if style == "llama" else DecoderLMConfig.gpt
    return DecoderLM(factory(V, d_model=32, num_layers=2, num_heads=4, max_len=20)).eval()


def reference_greedy(model: DecoderLM, prompt: torch.Tensor, n: int) -> torch.Tensor:
    ids = prompt
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.parametrize("style", ["llama", "gpt"])
def test_greedy_matches_full_recomputation(style: str) -> None:
    model = make(style)
    prompt = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(1))
    out = generate(model, prompt, 6)
    assert torch.equal(out, reference_greedy(model, prompt, 6))
    assert torch.equal(generate(model, prompt, 6, use_cache=False), out)


@pytest.mark.parametrize("style", ["llama", "gpt"])
def test_left_padded_batch_equals_each_prompt_alone(style: str) -> None:
    model = make(style)
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    batched = generate(model, ids, 5, attention_mask=mask)
    for row, p in enumerate(prompts):
        alone = generate(model, torch.tensor([p]), 5)
        assert batched[row, P:].tolist() == alone[0, len(p):].tolist()
    sampled = generate(model, ids, 5, attention_mask=mask, do_sample=True, top_k=8, seed=3)
    uncached = generate(model, ids, 5, attention_mask=mask, do_sample=True, top_k=8, seed=3,
                        use_cache=False)
    assert torch.equal(sampled, uncached)


def test_sampling_is_reproducible_with_seed() -> None:
    model = make()
    prompt = torch.tensor([[1, 2, 3]])
    kwargs = dict(do_sample=True, temperature=0.9, top_p=0.9, repetition_penalty=1.2)
    a = generate(model, prompt, 8, seed=11, **kwargs)
    b = generate(model, prompt, 8, seed=11, **kwargs)
    assert torch.equal(a, b)
    assert a.shape == (1, 11)


def test_eos_stops_and_pads_finished_rows() -> None:
    model = make()
    prompt = torch.tensor([[3, 4], [5, 6]])
    free = generate(model, prompt, 6)
    eos = int(free[0, 3])  # the second token row 0 generates
    out = generate(model, prompt, 6, eos_token_id=eos, pad_token_id=0)
    first = (free[0, 2:] == eos).nonzero()[0].item()
    assert out[0, 2 + first] == eos
    assert (out[0, 3 + first:] == 0).all()
    assert out.shape[1] <= free.shape[1]
    # All rows finished at once: generation stops early.
    single = generate(model, prompt[:1], 6, eos_token_id=int(free[0, 2]))
    assert single.shape == (1, 3)


def test_streamer_gets_every_token() -> None:
    class Collect:
        def __init__(self) -> None:
            self.tokens, self.ended = [], 0

        def put(self, ids: torch.Tensor) -> None:
            self.tokens.append(ids.tolist())

        def end(self) -> None:
            self.ended += 1

    model = make()
    streamer = Collect()
    out = generate(model, torch.tensor([[1, 2]]), 4, streamer=streamer)
    assert [t[0] for t in streamer.tokens] == out[0, 2:].tolist()
    assert streamer.ended == 1


def test_bad_input() -> None:
    model = make()
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="input_ids: expected at least one token"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, 3, do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, 3, do_sample=True, top_p=1.1)
    with pytest.raises(ValueError, match="max_new_tokens: the prompt has 3 tokens and the model "
                       "takes at most 20 positions, so at most 17 new tokens fit; got "
                       "max_new_tokens=18"):
        generate(model, prompt, 18)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt, -1)
    with pytest.raises(ValueError, match="left padding"):
        generate(model, prompt, 2, attention_mask=torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="input_ids: expected integer"):
        generate(model, torch.ones(1, 3), 2)
    assert torch.equal(generate(model, prompt, 0), prompt)


def reference_stop(new: list[int], eos: set[int], decode, stops: list[str]) -> int:
    """How many of ``new`` a row keeps: up to the first end id or the token completing a stop
    string (that token included)."""
    for i, t in enumerate(new):
        if t in eos or any(s in decode(new[:i + 1]) for s in stops):
            return i + 1
    return len(new)


class TwoChars:
    """A toy tokenizer: token i decodes to two letters, so a stop string can end inside a
    token (Hugging Face's "overhang")."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i) + chr(65 + i) for i in ids)


def test_eos_list_any_id_finishes_a_row_and_pads_with_the_first() -> None:
    model = make()
    prompt = torch.tensor([[3, 4], [5, 6], [7, 8]])
    free = generate(model, prompt, 8)
    eos = [int(free[0, 4]), int(free[1, 3])]  # row 0's third and row 1's second new token
    out = generate(model, prompt, 8, eos_token_id=eos)
    for row in range(3):
        new = free[row, 2:].tolist()
        keep = reference_stop(new, set(eos), None, [])
        assert out[row, 2:2 + keep].tolist() == new[:keep]
        assert (out[row, 2 + keep:] == eos[0]).all()
    assert torch.equal(generate(model, prompt, 8, eos_token_id=tuple(eos)), out)
    assert torch.equal(generate(model, prompt, 8, eos_token_id=torch.tensor(eos)), out)
    padded = generate(model, prompt, 8, eos_token_id=eos, pad_token_id=1)
    assert torch.equal(padded[out != eos[0]], out[out != eos[0]])


def test_max_length_counts_the_prompt() -> None:
    model = make()
    prompt = torch.tensor([[1, 2, 3]])
    assert torch.equal(generate(model, prompt, max_length=7), generate(model, prompt, 4))
    assert torch.equal(generate(model, prompt, 4, max_length=7), generate(model, prompt, 4))
    assert torch.equal(generate(model, prompt, max_length=3), prompt)
    with pytest.raises(ValueError, match=r"max_length: 9 contradicts max_new_tokens=4 for a "
                                         r"prompt of 3 tokens \(3 \+ 4 = 7\)"):
        generate(model, prompt, 4, max_length=9)
    with pytest.raises(ValueError, match="max_length: expected at least the prompt length 3"):
        generate(model, prompt, max_length=2)
    with pytest.raises(ValueError, match=r"max_length: the prompt has 3 tokens .* at most 17 new "
                                         r"tokens fit; got max_length=21"):
        generate(model, prompt, max_length=21)
    with pytest.raises(ValueError, match="got neither"):
        generate(model, prompt)


def test_temperature_zero_is_greedy_when_not_sampling() -> None:
    model = make()
    prompt = torch.tensor([[1, 2, 3]])
    assert torch.equal(generate(model, prompt, 4, temperature=0.0), generate(model, prompt, 4))
    with pytest.raises(ValueError, match=r"temperature: expected a finite float > 0 for sampling, "
                                         r"got 0.0 .*do_sample=False"):
        generate(model, prompt, 4, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="temperature: expected a finite float >= 0"):
        generate(model, prompt, 4, temperature=-1.0)


@pytest.mark.parametrize("use_cache", [True, False])
def test_stop_strings_left_padded_batch_with_eos_list(use_cache: bool) -> None:
    model, tok = make(), TwoChars()
    prompts = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    free = generate(model, ids, 9, attention_mask=mask)
    new0, new1 = free[0, P:].tolist(), free[1, P:].tolist()
    # Row 0 stops on a string across tokens 3 and 4 ("xY" + "zZ" holds "Yz"), ending inside
    # token 4; row 1 on an end id.
    stop = tok.decode(new0[2:4])[1:3]
    eos = [new1[1], 18]
    out = generate(model, ids, 9, attention_mask=mask, eos_token_id=eos, stop_strings=[stop],
                   tokenizer=tok, use_cache=use_cache)
    kept = []
    for row in range(3):
        new = free[row, P:].tolist()
        keep = reference_stop(new, set(eos), tok.decode, [stop])
        kept.append(keep)
        assert out[row, P:P + keep].tolist() == new[:keep]
        assert (out[row, P + keep:] == eos[0]).all()
    assert kept[0] <= 4 and kept[1] <= 2
    assert out.shape[1] == P + max(kept)


def test_stop_string_ends_generation_and_the_streamer_stops_with_it() -> None:
    class Collect:
        def __init__(self) -> None:
            self.tokens: list[int] = []

        def put(self, ids: torch.Tensor) -> None:
            self.tokens += ids.tolist()

        def end(self) -> None:
            self.tokens.append(-1)

    model, tok = make(), TwoChars()
    prompt = torch.tensor([[1, 2]])
    free = generate(model, prompt, 10)[0, 2:].tolist()
    stop = tok.decode(free[3:5])[1:3]
    streamer = Collect()
    out = generate(model, prompt, 10, stop_strings=stop, tokenizer=tok, streamer=streamer)
    keep = reference_stop(free, set(), tok.decode, [stop])
    assert keep <= 5
    assert out[0, 2:].tolist() == free[:keep]
    assert streamer.tokens == [*free[:keep], -1]


def test_a_stop_string_over_several_tokens_late_in_the_text() -> None:
    # Five letters over three tokens, completed at new token 12: past the decoded tail of
    # 5 + 1 tokens that each step reads. Sampled (greedy repeats one token here); the same
    # seed draws the same tokens until a row stops.
    model, tok = make(), TwoChars()
    prompt = torch.tensor([[1, 2], [3, 4]])
    free = generate(model, prompt, 16, do_sample=True, seed=0)[:, 2:].tolist()
    stop = tok.decode(free[0][9:12])[1:6]
    out = generate(model, prompt, 16, do_sample=True, seed=0, stop_strings=stop, tokenizer=tok,
                   pad_token_id=0)
    keeps = [reference_stop(row, set(), tok.decode, [stop]) for row in free]
    assert keeps[0] == 12 and len(stop) == 5
    for row, keep in enumerate(keeps):
        assert out[row, 2:2 + keep].tolist() == free[row][:keep]
        assert (out[row, 2 + keep:] == 0).all()


def test_stop_strings_need_a_tokenizer_and_a_pad_for_batches() -> None:
    model = make()
    with pytest.raises(ValueError, match="tokenizer: stop_strings need a tokenizer"):
        generate(model, torch.tensor([[1, 2]]), 3, stop_strings=["ab"])
    with pytest.raises(ValueError, match="stop_strings: expected a non-empty string"):
        generate(model, torch.tensor([[1, 2]]), 3, stop_strings=[""], tokenizer=TwoChars())
    with pytest.raises(ValueError, match="stop_strings: expected"):
        generate(model, torch.tensor([[1, 2]]), 3, stop_strings=[], tokenizer=TwoChars())
    with pytest.raises(ValueError, match="pad_token_id: rows of a batch"):
        generate(model, torch.tensor([[1, 2], [3, 4]]), 3, stop_strings="ab",
                 tokenizer=TwoChars())


class Counting:
    """Counts the model's forward calls, to prove that a check ran before any compute."""

    def __init__(self, model: DecoderLM) -> None:
        self.calls = 0
        model.register_forward_pre_hook(self.hook)

    def hook(self, *_: object) -> None:
        self.calls += 1


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"input_ids": torch.tensor([[1, V]])}, ValueError,
     r"input_ids: expected ids in \[0, 19\), got min 1 and max 19 \(\[19\]"),
    ({"input_ids": torch.tensor([[-1, 2]])}, ValueError, r"input_ids: .* \(\[-1\]"),
    ({"input_ids": torch.tensor([[True, False]])}, ValueError,
     r"input_ids: expected integer token ids \(torch.long or torch.int32\) of shape B x L, got "
     "dtype torch.bool"),
    ({"input_ids": [[1, 2]]}, TypeError, "input_ids: expected a tensor of integer token ids"),
    ({"eos_token_id": V}, ValueError, r"eos_token_id: expected a token id in \[0, 19\)"),
    ({"eos_token_id": [2, -1]}, ValueError, r"eos_token_id\[1\]: expected a token id"),
    ({"eos_token_id": [2, True]}, TypeError, r"eos_token_id\[1\]: expected a token id"),
    ({"eos_token_id": []}, ValueError, "eos_token_id: expected one token id or a non-empty"),
    ({"eos_token_id": 2.0}, TypeError, "eos_token_id: expected a token id"),
    ({"pad_token_id": 99}, ValueError, r"pad_token_id: expected a token id in \[0, 19\)"),
    ({"attention_mask": torch.tensor([[0.5, 1.0]])}, ValueError, "attention_mask: expected 0/1"),
    ({"seed": 1.5}, ValueError, "seed: expected an int"),
])
def test_bad_ids_are_refused_before_any_compute(kwargs: dict, error: type, message: str) -> None:
    model = make()
    counter = Counting(model)
    args = {"input_ids": torch.tensor([[1, 2]]), **kwargs}
    with pytest.raises(error, match=message):
        generate(model, args.pop("input_ids"), 3, **args)
    assert counter.calls == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_logits_are_refused_greedy_and_sampling(bad: float) -> None:
    model = make()
    with torch.no_grad():
        model.lm_head.weight[4] = bad
    for do_sample in (False, True):
        with pytest.raises(ValueError, match=r"logits \(the model's output for new token 1\): "
                                             r"row 0 \(of 1\) holds (NaN|\+inf)"):
            generate(model, torch.tensor([[1, 2]]), 3, do_sample=do_sample)


@pytest.mark.parametrize("do_sample", [False, True])
def test_logits_are_checked_once_a_step(monkeypatch, do_sample: bool) -> None:
    checked: list[str] = []
    # The package's `generate` is the function: the module is taken by its name.
    for name in ("attnlab.generation.generate", "attnlab.generation.sampling"):
        module = importlib.import_module(name)
        real = module.check_logits
        monkeypatch.setattr(module, "check_logits",
                            lambda logits, name="logits", _real=real: (checked.append(name),
                                                                       _real(logits, name))[1])
    model = make()
    out = generate(model, torch.tensor([[1, 2]]), 4, do_sample=do_sample, seed=0,
                   repetition_penalty=1.3)
    assert out.shape == (1, 6)
    assert checked == [f"logits (the model's output for new token {i})" for i in (1, 2, 3, 4)]


def test_seed_outside_torch_range_is_refused() -> None:
    model = make()
    for seed in (2**64, -(2**63) - 1, True):
        with pytest.raises(ValueError, match=r"seed: expected an int in \[-2\*\*63, 2\*\*64\)"):
            generate(model, torch.tensor([[1, 2]]), 2, do_sample=True, seed=seed)
    assert generate(model, torch.tensor([[1, 2]]), 2, do_sample=True, seed=2**64 - 1).shape \
        == (1, 4)


def test_prompt_longer_than_the_model_names_lengths_not_a_negative_count() -> None:
    model = make()
    prompt = torch.ones(1, 25, dtype=torch.long)
    room = model.config.max_len - prompt.shape[1]  # what a caller may compute: -5
    with pytest.raises(ValueError, match="input_ids: the prompt has 25 tokens, more than the "
                                         "model's limit of 20 positions"):
        generate(model, prompt, min(8, room))


MODEL = make()
letters = st.text("abcdefghijklmnopqrsABCDEFGHIJKLMNOPQRS", min_size=1, max_size=3)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=4), min_size=1, max_size=3),
       st.lists(st.integers(0, V - 1), max_size=2), st.lists(letters, max_size=2),
       st.integers(1, 6), st.booleans())
def test_batched_stops_equal_each_row_alone(prompts: list[list[int]], eos: list[int],
                                            stops: list[str], n: int, use_cache: bool) -> None:
    tok = TwoChars()
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    out = generate(MODEL, ids, n, attention_mask=mask, eos_token_id=eos or None,
                   pad_token_id=0, stop_strings=stops or None, tokenizer=tok,
                   use_cache=use_cache)
    keeps = []
    for row, p in enumerate(prompts):
        free = generate(MODEL, torch.tensor([p]), n)[0, len(p):].tolist()
        keep = reference_stop(free, set(eos), tok.decode, stops)
        keeps.append(keep)
        assert out[row, P:P + keep].tolist() == free[:keep]
        assert (out[row, P + keep:] == 0).all()
    assert out.shape[1] == P + max(keeps)


def test_a_model_without_the_protocol_is_refused_by_name() -> None:
    """generate drives any CausalLM (attnlab.generation.protocols); an encoder-decoder or
    another object is named, not met with an AttributeError halfway through."""
    seq2seq = Transformer(TransformerConfig(8, 8, d_model=8, num_heads=2, num_encoder_layers=1,
                                            num_decoder_layers=1, d_ff=8, max_len=8))
    ids = torch.zeros(1, 2, dtype=torch.long)
    for bad, name in ((seq2seq, "Transformer"), (None, "NoneType"), ("gpt2", "str")):
        with pytest.raises(TypeError, match=f"model: expected a causal LM .*got {name}$"):
            generate(bad, ids, 2)
