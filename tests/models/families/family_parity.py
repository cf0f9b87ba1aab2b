"""Shared checks for the family parity tests: a tiny random transformers checkpoint saved to a
folder, loaded by ``attnlab.models.from_pretrained``, compared logit for logit (left padding
included) and token for token under greedy generation."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from attnlab.generation import generate
from attnlab.models.io import from_pretrained, save_pretrained

V = 96


def tiny_checkpoint(folder: Path, model_cls: type, config: object, *,
                    dtype: torch.dtype = torch.float32, shard: str | None = None,
                    seed: int = 0) -> nn.Module:
    """A random ``model_cls(config)`` with every norm and bias moved off its initial value
    (so that a missed bias or a wrong norm formula shows), saved to ``folder``; returned in
    eval mode."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return model


def left_padded_batch(seed: int = 1, vocab: int = V, lengths: tuple[int, ...] = (13, 7, 10)
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids B x L, attention_mask B x L)`` with rows left-padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), L), generator=g)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, L - n:] = 1
    return ids * mask, mask


def assert_logits_match(hf: nn.Module, ours: nn.Module, *, atol: float = 1e-4,
                        seed: int = 1, lengths: tuple[int, ...] = (13, 7, 10),
                        hf_positions_from_mask: bool = False) -> None:
    """Logits of a left-padded batch agree at every real position within ``atol``.

    transformers' forward numbers the positions ``0 .. L-1`` whatever the padding (its
    ``generate`` counts real tokens, as we always do); RoPE does not see the shift, learned
    positions (GPT-2) do: ``hf_positions_from_mask`` passes transformers ``generate``'s
    ``position_ids``.
    """
    ids, mask = left_padded_batch(seed, vocab=ours.config.vocab_size, lengths=lengths)
    positions = (mask.cumsum(-1) - 1).clamp(min=0) if hf_positions_from_mask else None
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
        got = ours(ids, mask).float()
    real = mask.bool()
    err = (expected - got)[real].abs().max().item()
    assert err <= atol, f"max |logit difference| {err:.3g} > {atol}"


def assert_greedy_match(hf: nn.Module, ours: nn.Module, *, new_tokens: int = 16,
                        seed: int = 2, lengths: tuple[int, ...] = (13, 7, 10),
                        use_cache: bool = True) -> None:
    """Greedy generation from a left-padded batch gives the same tokens as transformers'."""
    ids, mask = left_padded_batch(seed, vocab=ours.config.vocab_size, lengths=lengths)
    with torch.no_grad():
        expected = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
    got = generate(ours, ids, new_tokens, attention_mask=mask, eos_token_id=None,
                   use_cache=use_cache)
    assert torch.equal(got, expected), (got[:, ids.shape[1]:], expected[:, ids.shape[1]:])


def assert_cache_matches_full(ours: nn.Module, *, seed: int = 3) -> None:
    """Prefill + one-token steps through the KV cache equal one full forward."""
    ids, mask = left_padded_batch(seed, vocab=ours.config.vocab_size)
    with torch.no_grad():
        full = ours(ids, mask)
        cache = ours.make_cache(ids.shape[0], ids.shape[1])
        steps = [ours(ids[:, :5], mask[:, :5], cache=cache)]
        for t in range(5, ids.shape[1]):
            steps.append(ours(ids[:, t:t + 1], mask[:, :t + 1], cache=cache))
    real = mask.bool()
    err = (torch.cat(steps, 1) - full)[real].abs().max().item()
    assert err <= 1e-5, f"cached vs full: max difference {err:.3g}"


def assert_save_round_trip(ours: nn.Module, model_cls: type, folder: Path, **kwargs: object
                           ) -> nn.Module:
    """``save_pretrained(ours, folder)``: transformers' ``model_cls`` loads it and its logits
    match ours (``kwargs`` to ``assert_logits_match``); returns that model."""
    save_pretrained(ours, folder)
    hf = model_cls.from_pretrained(folder).eval()
    assert_logits_match(hf, ours, **kwargs)
    return hf


def load(folder: Path, **kwargs: object) -> nn.Module:
    """``from_pretrained(folder, **kwargs)``."""
    return from_pretrained(folder, **kwargs)


def assert_cache_matches_transformers(hf: nn.Module, ours: nn.Module, *, atol: float = 1e-4,
                                      seed: int = 3) -> None:
    """Prefill + one-token steps through our KV cache give transformers' logits through its
    own cache, positions as its ``generate`` passes them (for dynamic RoPE, where the cached
    keys keep the rotation of their step, so cached != full in both libraries)."""
    ids, mask = left_padded_batch(seed, vocab=ours.config.vocab_size)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ends = [5, *range(6, ids.shape[1] + 1)]
    with torch.no_grad():
        cache, past, start = ours.make_cache(ids.shape[0], ids.shape[1]), None, 0
        for end in ends:
            got = ours(ids[:, start:end], mask[:, :end], cache=cache)
            out = hf(input_ids=ids[:, start:end], attention_mask=mask[:, :end],
                     position_ids=positions[:, start:end], past_key_values=past, use_cache=True)
            past = out.past_key_values
            real = mask[:, start:end].bool()
            err = (out.logits.float() - got.float())[real].abs().max().item()
            assert err <= atol, f"step ending at {end}: max |logit difference| {err:.3g}"
            start = end
