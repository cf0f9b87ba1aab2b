"""A left-padded prefill skips the padded positions in each block's MLP (row by row, so only
the real rows are computed): the same logits and the same cache for every real position as a
forward that computes them all, and the full computation wherever a padded position's output
could be seen (all logits, a loss, right padding, a hook, a gradient)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.modules import module as torch_module

from attnlab.layers import GatedMLP
from attnlab.models import DecoderLM, DecoderLMConfig

V = 64


def tiny(dtype: torch.dtype = torch.float32) -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(V, d_model=32, num_layers=2, num_heads=4, max_len=64)
    return DecoderLM(config).to(dtype).eval()


def left_padded(lengths: tuple[int, ...] = (12, 9, 5, 3), L: int = 12
                ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, V, (len(lengths), L), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(len(lengths), L, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, L - n:] = True
    return ids, mask


def mlp_rows(monkeypatch) -> list[int]:
    """The rows each GatedMLP call computes (B * L for a full call, fewer when skipping)."""
    seen, real = [], GatedMLP.forward

    def counting(self, x):
        seen.append(x.numel() // x.shape[-1])
        return real(self, x)

    monkeypatch.setattr(GatedMLP, "forward", counting)
    return seen


def full(model: DecoderLM, *args, **kwargs) -> torch.Tensor:
    """The forward with every row computed: a do-nothing global hook turns skipping off."""
    handle = torch_module.register_module_forward_hook(lambda *a: None)
    try:
        return model(*args, **kwargs)
    finally:
        handle.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_runs_only_the_real_rows_and_the_logits_are_the_same(monkeypatch,
                                                                      dtype) -> None:
    model, (ids, mask) = tiny(dtype), left_padded()
    seen = mlp_rows(monkeypatch)
    with torch.inference_mode():
        skipped = model(ids, mask, logits_to_keep=1)
        assert seen == [int(mask.sum())] * 2  # 29 of 48 rows, in both blocks
        seen.clear()
        computed = full(model, ids, mask, logits_to_keep=1)
        assert seen == [ids.numel()] * 2
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(skipped, computed, rtol=tol, atol=tol)


def test_the_cache_holds_the_same_keys_for_every_real_position(monkeypatch) -> None:
    """Decoding on after a skipping prefill gives the tokens of a full one."""
    model, (ids, mask) = tiny(), left_padded()
    seen = mlp_rows(monkeypatch)
    with torch.inference_mode():
        tokens = model.generate(ids, 6, attention_mask=mask)
        assert seen[:2] == [int(mask.sum())] * 2  # generate's prefill skipped the padding
        handle = torch_module.register_module_forward_hook(lambda *a: None)
        try:
            expected = model.generate(ids, 6, attention_mask=mask)
        finally:
            handle.remove()
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize("case", ["all logits", "loss", "right padding", "few pads", "hook",
                                  "gradient"])
def test_every_row_runs_where_a_padded_output_could_be_seen(monkeypatch, case) -> None:
    model = tiny()
    ids, mask = left_padded((12, 12, 12, 12, 12, 12, 12, 11)) if case == "few pads" else \
        left_padded()
    if case == "right padding":
        mask = mask.flip(1)
    kwargs = {"logits_to_keep": 1}
    if case == "all logits":
        kwargs = {}
    elif case == "loss":
        kwargs = {"labels": ids.masked_fill(~mask, -100)}
    elif case == "hook":
        model.layers[1].mlp.up_proj.register_forward_hook(lambda *a: None)
    seen = mlp_rows(monkeypatch)
    with torch.set_grad_enabled(case == "gradient"):
        model(ids, mask, **kwargs)
    assert seen == [ids.numel()] * 2
