"""Pure functions that turn next-token logits into a token: temperature, top-k, top-p,
repetition penalty, sampling (min-p and OpenAI's penalties: ``processors.py``).

Each function takes logits ``N.. x V`` (usually ``B x V``) and returns a new tensor; none
changes its input. Filtering sets the logits of removed tokens to ``-inf``; the order
(the one of Hugging Face) is: repetition penalty, temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from attnlab._checks import check_positive, is_int, is_number
from attnlab.generation.processors import min_p_filter, per_row

__all__ = [
    "GreedyTokens",
    "apply_repetition_penalty",
    "check_logits",
    "check_sampling_args",
    "greedy_tokens",
    "sample_logits",
    "sampling_probs",
    "top_k_filter",
    "top_p_filter",
    "unusable_rows",
]


# top-p looks for its nucleus among this many highest-ranked tokens before sorting them all:
# nuclei are small next to a vocabulary of 32k-256k tokens, and a sort of all V costs more
# than the rest of a draw (`python -m devbench sampling` measures both).
_TOP_P_CANDIDATES = 1024
# A per-row repetition penalty must be > 0: the smallest positive float stands for "> 0" in
# per_row's closed range.
_SMALLEST_PENALTY = 5e-324


def sample_logits(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None,
                  generator: torch.Generator | None = None, *, check: bool = True,
                  min_p: float | Sequence[float] | Tensor | None = None) -> Tensor:
    """Draw one token per row from ``sampling_probs(logits, temperature, top_k, top_p,
    min_p=min_p)``.

    logits ``N.. x V`` -> token ids ``N..`` (long). ``generator`` makes the draw reproducible.
    A row that holds NaN or +inf, or only -inf, gives a ``ValueError`` (``check_logits``);
    ``check=False`` skips the checks for a caller that made them (``generate``, once a step).
    """
    probs = sampling_probs(logits, temperature, top_k, top_p, check=check, min_p=min_p)
    flat = probs.reshape(-1, probs.shape[-1])
    # Inverse CDF: the first token whose cumulative probability exceeds u * total, one uniform
    # u per row. The same law as torch.multinomial, at a fraction of its cost over a large
    # vocabulary (`python -m devbench sampling` compares them). A token of probability 0 is
    # never drawn: the cumulative sum only rises at a positive probability, and the target
    # stays below the total.
    cdf = flat.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=flat.device, dtype=cdf.dtype)
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    ids = torch.searchsorted(cdf, target, right=True)
    return ids.view(probs.shape[:-1])


class GreedyTokens(nn.Module):
    """``greedy_tokens`` as a module, so that a model can own its greedy choice and a fast
    module (``attnlab.kernels.FastGreedyTokens``) can stand in for it: logits ``N.. x V`` ->
    ids ``N..``."""

    def forward(self, logits: Tensor) -> Tensor:
        return greedy_tokens(logits)


def greedy_tokens(logits: Tensor) -> Tensor:
    """The most likely token of each row (the first of equal maxima): logits ``N.. x V`` ->
    ids ``N..`` (long). 16-bit logits on a CPU are widened first, which is exact (PyTorch has
    no vectorised 16-bit argmax)."""
    if logits.dtype in (torch.bfloat16, torch.float16) and logits.device.type == "cpu":
        logits = logits.float()
    return logits.argmax(dim=-1)


def sampling_probs(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, *, check: bool = True,
                   min_p: float | Sequence[float] | Tensor | None = None) -> Tensor:
    """``softmax(filter(logits / temperature))``: the distribution ``sample_logits`` draws from.
    The filters, in transformers' order: top-k, top-p, min-p (``processors.min_p_filter``,
    one value for all rows or one per row).

    logits ``N.. x V`` -> probabilities ``N.. x V`` (float32 or wider). Each row is shifted
    by its maximum before the division, so that a tiny temperature cannot overflow to
    ``inf / inf = NaN``: the largest logits become 0, the others ``-inf`` or very negative.
    The arguments and ``check_logits`` are checked first unless ``check`` is false (for a
    caller that has checked them already).
    """
    if check:
        check_sampling_args(temperature, top_k, top_p)
        check_logits(logits)
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    scaled = (wide - wide.amax(dim=-1, keepdim=True)) / temperature
    # The filters rank by the logits themselves: a huge temperature can round distinct
    # logits to one scaled value, and the tie must not drop the most likely token.
    if top_k is not None:
        scaled = top_k_filter(scaled, top_k, rank_by=wide)
    if top_p is not None:
        scaled = top_p_filter(scaled, top_p, rank_by=wide)
    if min_p is not None:
        scaled = min_p_filter(scaled.reshape(-1, scaled.shape[-1]), min_p).view(scaled.shape)
    return torch.softmax(scaled, dim=-1)


def top_k_filter(logits: Tensor, k: int, *, rank_by: Tensor | None = None) -> Tensor:
    """Keep exactly the ``k`` largest logits of each row, set the others to ``-inf``.

    Ties at the k-th value do not let more than ``k`` tokens through: among equal logits,
    the ones ``torch.topk`` picks are kept. ``k >= V`` keeps everything. ``rank_by``
    (``N.. x V``, ordered as ``logits`` but without the ties that rounding made, e.g. the
    logits before a temperature) ranks the tokens instead when given.
    """
    check_positive("top_k", k)
    if k >= logits.shape[-1]:
        return logits.clone()
    keys = logits if rank_by is None else rank_by
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.scatter_(-1, keys.topk(k, dim=-1).indices, True)
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits: Tensor, p: float, *, rank_by: Tensor | None = None) -> Tensor:
    """Nucleus filtering (Holtzman et al., 2019): keep the smallest set of most likely tokens
    whose probability sums to at least ``p``; set the others to ``-inf``.

    Sorted by probability ``q_1 >= q_2 >= ..``, token ``j`` is kept when
    ``q_1 + .. + q_(j-1) < p`` (so the most likely token is always kept). ``p = 1`` keeps all.
    ``rank_by`` breaks ties among equal probabilities, as in ``top_k_filter``.
    """
    if not is_number(p) or not 0.0 < p <= 1.0:
        raise ValueError(f"top_p: expected a float in (0, 1], got {p!r}")
    if p >= 1.0:
        return logits.clone()
    keys = logits if rank_by is None else rank_by
    if logits.shape[-1] > _TOP_P_CANDIDATES:
        kept = _top_p_among_candidates(logits, keys, p)
        if kept is not None:
            return logits.masked_fill(~kept, float("-inf"))
    order = keys.argsort(dim=-1, descending=True, stable=True)
    sorted_logits = logits.gather(-1, order)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove_sorted = mass_before >= p
    remove_sorted[..., 0] = False  # a p below float32's smallest number compares as 0
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def _top_p_among_candidates(logits: Tensor, keys: Tensor, p: float) -> Tensor | None:
    """``top_p_filter``'s kept set ``N.. x V`` (bool), found among the ``_TOP_P_CANDIDATES``
    highest-ranked tokens instead of sorting all ``V``; None when some row's nucleus may
    reach past them (the caller then sorts everything).

    The kept prefix is the global one when it ends before the last candidate on a strictly
    higher key: every token ranked above it is then a candidate, in the same (stable) order.
    """
    candidates = keys.topk(_TOP_P_CANDIDATES, dim=-1).indices.sort(dim=-1).values
    ranked = keys.gather(-1, candidates)
    ranked, order = ranked.sort(dim=-1, descending=True, stable=True)
    candidates = candidates.gather(-1, order)  # by key, ties by index: the stable order
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, candidates)
    keep = probs.cumsum(dim=-1) - probs < p
    keep[..., 0] = True  # a p below float32's smallest number compares as 0
    count = keep.sum(dim=-1, keepdim=True)  # the kept tokens are a prefix: the mass only grows
    last_kept = ranked.gather(-1, count - 1)
    if not bool(((count < _TOP_P_CANDIDATES) & (last_kept > ranked[..., -1:])).all()):
        return None
    return torch.zeros_like(logits, dtype=torch.bool).scatter(-1, candidates, keep)


def apply_repetition_penalty(logits: Tensor, token_ids: Tensor,
                             penalty: float | Sequence[float] | Tensor,
                             token_mask: Tensor | None = None) -> Tensor:
    """CTRL's penalty (Keskar et al., 2019) on every token already in the sequence.

    For a token ``t`` present in ``token_ids`` (``B x T``, where ``token_mask`` ``B x T``,
    if given, is True): ``logit_t / penalty`` if ``logit_t > 0`` else ``logit_t * penalty``,
    so ``penalty > 1`` makes repeats less likely. logits ``B x V`` -> ``B x V``. ``penalty``
    is one number > 0 or one per row (a sequence or 1-d tensor of ``B``; 1 leaves a row as is).
    """
    if token_ids.dim() != 2 or token_ids.shape[0] != logits.shape[0] or logits.dim() != 2:
        raise ValueError(f"token_ids: expected shape B x T with B = {logits.shape[0]} for "
                         f"logits B x V, got {tuple(token_ids.shape)} and {tuple(logits.shape)}")
    if is_number(penalty):
        check_sampling_args(1.0, None, None, penalty)
        if penalty == 1.0:
            return logits.clone()
    else:
        penalty = per_row("repetition_penalty", penalty, logits.shape[0],
                          (_SMALLEST_PENALTY, math.inf), "a finite number > 0"
                          ).to(logits.dtype)
    if token_ids.shape[1] == 0:
        return logits.clone()
    weight = torch.ones_like(token_ids, dtype=torch.float32)
    if token_mask is not None:
        weight = weight * token_mask.float()
    counts = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    seen = counts.scatter_add_(-1, token_ids, weight) > 0
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def unusable_rows(logits: Tensor) -> Tensor:
    """logits ``N.. x V`` -> ``N..`` bool, True where no token can be chosen (NaN, +inf, or
    every entry ``-inf``): ``check_logits``'s test, for a caller that handles rows alone."""
    # The row's maximum is NaN if it holds one (amax propagates NaN), +inf if it holds +inf,
    # -inf if every entry is: one reduction instead of three passes (10x less time).
    return ~logits.amax(dim=-1).isfinite()


def check_logits(logits: Tensor, name: str = "logits") -> None:
    """Refuse logits ``N.. x V`` from which no token can be chosen: a row with NaN or +inf
    (softmax gives NaN, argmax an arbitrary token), or with every entry ``-inf``.

    ``-inf`` alone marks a removed token and is fine. ``name`` is how the message names them.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() == 0 \
            or logits.shape[-1] == 0:
        got = (f"{logits.dtype} of shape {tuple(logits.shape)}" if isinstance(logits, Tensor)
               else type(logits).__name__)
        raise ValueError(f"{name}: expected a floating-point tensor N.. x V with V >= 1, "
                         f"got {got}")
    flat = logits.detach().reshape(-1, logits.shape[-1])
    bad = unusable_rows(flat)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        what = ("NaN" if flat[row].isnan().any() else "+inf" if (flat[row] == math.inf).any()
                else "only -inf (no token left)")
        raise ValueError(f"{name}: row {row} (of {flat.shape[0]}) holds {what}; expected finite "
                         "values, with -inf only for removed tokens (NaN or inf logits come "
                         "from NaN weights or an overflow, e.g. in float16)")


def check_sampling_args(temperature: float, top_k: int | None, top_p: float | None,
                        repetition_penalty: float = 1.0, *, do_sample: bool = True) -> None:
    """Raise a ``ValueError`` naming the first bad argument.

    Greedy decoding (``do_sample=False``) does not use the temperature, so ``0`` (a common
    way to ask for greedy decoding) is accepted there, as Hugging Face does.
    """
    if (not is_number(temperature, finite=True) or temperature < 0
            or (do_sample and temperature == 0)):
        expected = "> 0 for sampling" if do_sample else ">= 0"
        raise ValueError(f"temperature: expected a finite float {expected}, got {temperature!r}"
                         + (" (temperature 0 means greedy: pass do_sample=False)"
                            if do_sample and temperature == 0 else ""))
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k: expected None or a positive int, got {top_k!r}")
    if top_p is not None and (not is_number(top_p) or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p: expected None or a float in (0, 1], got {top_p!r}")
    if not is_number(repetition_penalty, finite=True) or not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty: expected a finite float > 0, got "
                         f"{repetition_penalty!r}")
