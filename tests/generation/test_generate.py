"""generate() for DecoderLM against a plain greedy loop, with batches, padding, sampling."""

from __future__ import annotations

import pytest
import torch

from attnlab.generation import generate
from attnlab.models import DecoderLM, DecoderLMConfig

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
    with pytest.raises(ValueError, match="input_ids: expected a non-empty B x P"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, 3, do_sample=True, top_p=0.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompt, 3, do_sample=True, top_p=1.1)
    with pytest.raises(ValueError, match="max_new_tokens: the prompt has 3 tokens and the model takes at most 20 "
                       "positions, so at most 17 new tokens fit; got max_new_tokens=18"):
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
