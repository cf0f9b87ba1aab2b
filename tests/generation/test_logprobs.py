"""Token log-probabilities: generate(logprobs=k) against transformers' log_softmax of its own
logits on the same random checkpoint, batched (left-padded) and single; the per-token entries
(text, bytes, offsets) and OpenAI's two forms built from them."""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from attnlab.bench.versus import random_checkpoint
from attnlab.generation import generate
from attnlab.generation.controls import GenerationOutput
from attnlab.generation.logprobs import (
    chat_logprobs,
    completions_logprobs,
    step_logprobs,
    token_entries,
)
from attnlab.models.io import from_pretrained
from attnlab.tokenizer import Tokenizer
from conftest import assert_close

transformers = pytest.importorskip("transformers")

SIZES = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    folder, _ = random_checkpoint(tmp_path_factory.mktemp("qwen2-logprobs"), "qwen2", SIZES)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return from_pretrained(folder).eval(), hf


def _hf_logprobs(hf, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("batched", [False, True])
def test_logprobs_equal_transformers_log_softmax(pair, batched: bool) -> None:
    model, hf = pair
    prompts = [[5, 9, 14, 3, 7], [11, 2]] if batched else [[5, 9, 14, 3, 7]]
    P, n, k = max(map(len, prompts)), 6, 4
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    out = generate(model, ids, n, attention_mask=mask, logprobs=k, prompt_logprobs=True,
                   repetition_penalty=1.3, logit_bias={4: 2.0})  # processors do not count
    assert isinstance(out, GenerationOutput) and out.sequences.shape == (len(prompts), P + n)
    full_mask = torch.cat([mask, torch.ones(len(prompts), n, dtype=torch.long)], dim=1)
    lp = _hf_logprobs(hf, out.sequences, full_mask)  # position i predicts token i + 1
    seq = out.sequences
    expected = lp[:, P - 1:-1].gather(-1, seq[:, P:, None])[..., 0]
    assert_close(out.logprobs, expected, rtol=1e-4, atol=1e-5, what="new tokens")
    top = lp[:, P - 1:-1].topk(k, dim=-1)
    assert_close(out.top_logprobs, top.values, rtol=1e-4, atol=1e-5, what="alternatives")
    assert torch.equal(out.top_ids, top.indices)
    for row, p in enumerate(prompts):
        first = P - len(p)
        got = out.prompt_logprobs[row, first:]
        assert math.isnan(got[0]) and got[1:].isfinite().all()
        assert out.prompt_logprobs[row, :first].isnan().all()  # padding has no value
        want = lp[row, first:P - 1].gather(-1, seq[row, first + 1:P, None])[..., 0]
        assert_close(got[1:], want, rtol=1e-4, atol=1e-5, what=f"prompt row {row}")


def test_logprobs_zero_alternatives_and_echo_only(pair) -> None:
    """k = 0 gives the chosen token's value alone; max_new_tokens = 0 with prompt_logprobs
    scores a prompt (what lm-eval's loglikelihood asks for)."""
    model, hf = pair
    ids = torch.tensor([[5, 9, 14, 3]])
    out = generate(model, ids, 0, logprobs=0, prompt_logprobs=True)
    assert out.logprobs.shape == (1, 0) and out.prompt_top_ids.shape == (1, 4, 0)
    lp = _hf_logprobs(hf, ids, torch.ones_like(ids))
    want = lp[0, :-1].gather(-1, ids[0, 1:, None])[..., 0]
    assert_close(out.prompt_logprobs[0, 1:], want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"logprobs: expected an int in \[0, 20\]"):
        generate(model, ids, 1, logprobs=21)
    with pytest.raises(ValueError, match=r"prompt_logprobs: .* logprobs=k"):
        generate(model, ids, 1, prompt_logprobs=True)


def _tokenizer(tmp_path) -> Tokenizer:
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["hello world, the fox", "日本 the world"], trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer.from_pretrained(tmp_path)


def test_entries_give_text_bytes_offsets_and_both_forms(tmp_path) -> None:
    tok = _tokenizer(tmp_path)
    prompt, new = tok.encode("hello"), tok.encode(" world 本")
    ids = prompt + new
    logits = torch.randn(len(ids), tok.vocab_size, generator=torch.Generator().manual_seed(0))
    chosen, top_ids, top_values = step_logprobs(logits, torch.tensor(ids), 3)
    chosen[0] = math.nan  # the first prompt token has no value
    entries = token_entries(ids, chosen.tolist(), top_ids.tolist(), top_values.tolist(), tok)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == "hello world 本"
    assert [e.text_offset for e in entries] == [len(tok.decode(ids[:i]))
                                               for i in range(len(ids))]
    # 本 is three bytes; a byte-level vocabulary this small splits it: no whole UTF-8 text
    assert any(e.token.startswith("bytes:\\x") for e in entries)
    completions = completions_logprobs(entries)
    assert completions["token_logprobs"][0] is None and completions["top_logprobs"][0] is None
    assert completions["token_logprobs"][1:] == pytest.approx(chosen[1:].tolist())
    assert len(completions["top_logprobs"][1]) <= 3
    chat = chat_logprobs(token_entries(new, chosen[len(prompt):].tolist(),
                                       top_ids[len(prompt):].tolist(),
                                       top_values[len(prompt):].tolist(), tok,
                                       context=prompt))
    first = chat["content"][0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert bytes(first["bytes"]) == tok.token_bytes(new[0])
    assert [t["logprob"] for t in first["top_logprobs"]] == pytest.approx(
        top_values[len(prompt)].tolist())
    # the most likely alternative is the row's maximum of log_softmax
    assert first["top_logprobs"][0]["logprob"] == pytest.approx(
        torch.log_softmax(logits[len(prompt)], -1).max().item())
