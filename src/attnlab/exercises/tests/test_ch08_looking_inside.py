"""Checks of tutorial 8's exercises (``attnlab exercises check 8``)."""

from dataclasses import replace

import torch

from attnlab.analysis import run_with_cache
from attnlab.analysis.metrics import previous_token_share
from attnlab.exercises.checks import assert_close, assert_equal, learner
from attnlab.models import DecoderLM, DecoderLMConfig


def chapter():
    return learner(__file__)


def random_weights(*shape):
    torch.manual_seed(0)
    return torch.softmax(torch.randn(*shape) * 3, dim=-1)


def test_8_1_two_back_share():
    w = random_weights(2, 3, 6, 6)
    expected = torch.stack([w[..., i, i - 2] for i in range(2, 6)], -1).sum(-1) / 6
    assert_close(chapter().two_back_share(w), expected, name="two_back_share(w), w 2 x 3 x 6 x 6")


def test_8_2_previous_token_head():
    w = random_weights(4, 2, 3, 7, 7)  # B x N x H x L x L
    w[:, 1, 2] = torch.eye(7).roll(-1, dims=1).tril() * 0.9 + 0.1 / 7  # a previous-token head
    share = previous_token_share(w).mean(0)
    expected = divmod(int(share.argmax()), 3)
    assert_equal(tuple(chapter().previous_token_head(w)), expected,
                 name="previous_token_head (layer, head)")


def test_8_3_ablate_z():
    torch.manual_seed(0)
    z = torch.randn(3, 4, 5, 2)
    zero = z.clone()
    zero[:, [1, 3]] = 0
    assert_close(chapter().ablate_z(z, [1, 3], "zero"), zero, name="ablate_z(z, [1, 3], 'zero')")
    mean = z.clone()
    mean[:, 2] = z[:, 2].mean(dim=(0, 1))
    assert_close(chapter().ablate_z(z, [2], "mean"), mean, name="ablate_z(z, [2], 'mean')")
    assert_close(z, torch.randn(3, 4, 5, 2, generator=torch.Generator().manual_seed(0)),
                 name="z after ablate_z (it must not change its input)")


def test_8_4_patterns_on_any_backend():
    torch.manual_seed(0)
    config = DecoderLMConfig.gpt(16, d_model=32, num_layers=2, num_heads=4, max_len=32)
    auto = DecoderLM(config).eval()
    flash = DecoderLM(replace(config, backend="flash")).eval()
    flash.load_state_dict(auto.state_dict())
    ids = torch.randint(0, 16, (2, 9))
    expected = run_with_cache(auto, ids, "*.pattern")[1]
    got = chapter().patterns_on_any_backend(flash, ids)
    assert_equal(sorted(got), sorted(expected), name="the hook points returned")
    for name, weights in expected.items():
        assert_close(got[name], weights, atol=1e-6, name=f"{name} on the flash model")
    assert_equal([layer.self_attn.backend for layer in flash.layers], ["flash", "flash"],
                 name="the layers' backends afterwards (put them back)")


def test_8_5_induction_share():
    n = 5
    w = random_weights(2, 3, 2 * n, 2 * n)
    expected = torch.stack([w[..., i, i - n + 1] for i in range(n, 2 * n)], -1).mean(-1)
    assert_close(chapter().induction_share(w, n), expected,
                 name="induction_share(w, 5), w 2 x 3 x 10 x 10")
    copy = torch.zeros(2 * n, 2 * n)
    copy[torch.arange(n, 2 * n), torch.arange(1, n + 1)] = 1.0  # a perfect induction head
    assert_close(chapter().induction_share(copy, n), torch.tensor(1.0),
                 name="induction_share of a head that always reads key i - n + 1")
