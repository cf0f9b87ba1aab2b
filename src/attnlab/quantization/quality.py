"""What quantizing cost a model, measured on text: perplexity, and against the reference
model's next-token distribution, the KL divergence and how often the top token agrees.

Computed as llama.cpp's ``perplexity`` tool does: the ``T`` token ids are cut into
``C = floor(T / N)`` non-overlapping chunks of ``N = context`` tokens (a remainder shorter
than a chunk is left out); each chunk is one forward from an empty cache, and only the
second half of each chunk is scored, so that every scored position sees at least ``N / 2``
tokens before it. In a chunk ``x_0 .. x_{N-1}``, the positions ``t = N/2 .. N-2`` predict
``x_{t+1}`` (``N - 1 - N/2`` positions a chunk), and over all scored positions ``t``:

    perplexity = exp(mean_t -log p(x_{t+1} | x_0..x_t))
    KL_t       = sum_v q_t(v) (log q_t(v) - log p_t(v))      (q: the reference, p: the model)
    top-1      = share of t with argmax_v p_t(v) == argmax_v q_t(v)

``KL`` is reported as its mean over the positions and its 99th percentile (linear
interpolation between the two nearest ranks, ``torch.quantile``'s). The token ids are taken
as given (llama.cpp puts a BOS token first in each chunk when the model asks for one; here
the caller's ids are the chunks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from attnlab._checks import is_int

__all__ = ["QualityResult", "chunk_scores", "measure_quality"]


@dataclass(frozen=True)
class QualityResult:
    """``measure_quality``'s figures over ``positions`` scored positions in ``chunks``
    chunks of ``context`` tokens; the reference's figures are None without a reference."""

    context: int
    chunks: int
    positions: int
    perplexity: float
    reference_perplexity: float | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    top1: float | None = None

    @property
    def perplexity_change(self) -> float | None:
        """``perplexity - reference_perplexity`` (None without a reference)."""
        if self.reference_perplexity is None:
            return None
        return self.perplexity - self.reference_perplexity


def measure_quality(model: nn.Module, ids: Tensor, *, context: int = 512,
                    reference: nn.Module | None = None,
                    progress: bool = False) -> QualityResult:
    """``model``'s perplexity on the token ``ids`` (``T``, int) in chunks of ``context``
    tokens and, with ``reference`` (a model over the same vocabulary), the KL divergence
    ``KL(reference || model)`` per position (mean and 99th percentile) and the top-1
    agreement (module docstring). A model is called as ``model(input_ids)`` (``1 x N`` ->
    logits ``1 x N x V``). ``progress`` draws a progress bar over the chunks on stderr."""
    if not is_int(context) or context < 4 or context % 2:
        raise ValueError(f"context: expected an even number of tokens >= 4, got {context!r}")
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point():
        got = (f"{ids.dtype} of shape {tuple(ids.shape)}" if isinstance(ids, Tensor)
               else type(ids).__name__)
        raise ValueError(f"ids: expected a 1-d integer tensor of token ids, got {got}")
    chunks = ids.numel() // context
    if chunks == 0:
        raise ValueError(f"ids: expected at least context={context} tokens (one chunk), "
                         f"got {ids.numel()}; give more text or a smaller context")
    scores: list[tuple[Tensor, ...]] = []
    for c in tqdm(range(chunks), desc="perplexity", unit="chunk", disable=not progress):
        chunk = ids[c * context:(c + 1) * context].view(1, -1)
        ref = None if reference is None else _logits(reference, chunk)
        scores.append(chunk_scores(_logits(model, chunk), chunk[0], ref))
    nll, *against = (torch.cat(column) for column in zip(*scores))
    perplexity = math.exp(nll.mean().item())
    if reference is None:
        return QualityResult(context, chunks, nll.numel(), perplexity)
    kl, same, reference_nll = against
    return QualityResult(context, chunks, nll.numel(), perplexity,
                         reference_perplexity=math.exp(reference_nll.mean().item()),
                         kl_mean=kl.mean().item(), kl_p99=torch.quantile(kl, 0.99).item(),
                         top1=same.float().mean().item())


def chunk_scores(logits: Tensor, chunk: Tensor,
                 reference: Tensor | None = None) -> tuple[Tensor, ...]:
    """One chunk's scored positions (its second half, module docstring): ``logits`` ``N x
    V`` (the model's), ``chunk`` the ``N`` ids -> ``(nll,)`` or, with the ``reference``'s
    logits ``N x V``, ``(nll, kl, same_top, reference_nll)``, each ``N - 1 - N/2``."""
    n = chunk.numel()
    first = n // 2
    targets = chunk[first + 1:]
    logp = F.log_softmax(logits[first:n - 1].float(), dim=-1)
    nll = -logp.gather(-1, targets[:, None]).squeeze(-1)
    if reference is None:
        return (nll,)
    logq = F.log_softmax(reference[first:n - 1].float(), dim=-1)
    kl = (logq.exp() * (logq - logp)).sum(-1)
    same = logp.argmax(-1) == logq.argmax(-1)
    return nll, kl, same, -logq.gather(-1, targets[:, None]).squeeze(-1)


def _logits(model: Callable[[Tensor], Tensor], chunk: Tensor) -> Tensor:
    with torch.no_grad():
        out = model(chunk)
    logits = out if isinstance(out, Tensor) else out.logits
    return logits[0]
