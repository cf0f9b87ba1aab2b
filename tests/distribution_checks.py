"""Checks that sampled token sequences follow a model's distribution: the exact probability of
every short continuation, and Pearson's chi-square test of counts against it (used by the
speculative-decoding tests of generation and serving)."""

from __future__ import annotations

import itertools

import torch

from attnlab.models import DecoderLM


def exact_distribution(model: DecoderLM, prompt: list[int], vocab: int, new: int
                       ) -> torch.Tensor:
    """P(t_1..t_new) for all ``vocab ** new`` continuations of ``prompt`` (in
    ``itertools.product`` order), from full forwards (no cache)."""
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=new)))
    ids = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        probs = model(ids).softmax(-1)[:, len(prompt) - 1:-1]  # rows x new x V
    return probs.gather(-1, seqs[..., None]).squeeze(-1).prod(-1)


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value, cells with an expected count below 5 pooled."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2.0), stat / 2))
