"""Tutorial 8, looking inside: the exercises.

Fill in each function, then run ``attnlab exercises check 8`` (or ``pytest exercises/``).
"""

from __future__ import annotations

# --8<-- [start:imports]
import torch
from torch import Tensor, nn

from attnlab.analysis import run_with_cache

# --8<-- [end:imports]

EXERCISES = {
    "8.1": "two_back_share",
    "8.2": "previous_token_head",
    "8.3": "ablate_z",
    "8.4": "patterns_on_any_backend",
    "8.5": "induction_share",
}


# --8<-- [start:two_back_share]
def two_back_share(w: Tensor) -> Tensor:
    """The mean over the L query rows of the weight two keys back, w[i, i - 2] (0 for the
    first two rows): w ``N.. x L x L`` -> ``N..``."""
    return torch.diagonal(w, offset=-2, dim1=-2, dim2=-1).sum(-1) / w.shape[-1]
# --8<-- [end:two_back_share]


# --8<-- [start:previous_token_head]
def previous_token_head(weights: Tensor) -> tuple[int, int]:
    """(layer, head) of the head with the largest previous-token share, the mean over query
    rows of w[i, i - 1], averaged over the batch: ``weights`` is ``B x N x H x L x L`` (as
    ``capture(...)["self"].weights``)."""
    share = torch.diagonal(weights, offset=-1, dim1=-2, dim2=-1).sum(-1) / weights.shape[-1]
    flat = share.mean(0).argmax().item()  # N x H, flattened
    return divmod(flat, weights.shape[2])
# --8<-- [end:previous_token_head]


# --8<-- [start:ablate_z]
def ablate_z(z: Tensor, heads: list[int], mode: str) -> Tensor:
    """The per-head outputs ``z`` (``B x H x L x D``, before W_o) with the ``heads`` ablated:
    set to 0 (``mode="zero"``) or to their mean over the batch and the positions
    (``mode="mean"``); the other heads unchanged. A new tensor."""
    out = z.clone()
    if mode == "zero":
        out[:, heads] = 0
    elif mode == "mean":
        out[:, heads] = z[:, heads].mean(dim=(0, 2), keepdim=True).expand_as(out[:, heads])
    else:
        raise ValueError(f"mode: expected 'zero' or 'mean', got {mode!r}")
    return out
# --8<-- [end:ablate_z]


# --8<-- [start:patterns_on_any_backend]
def patterns_on_any_backend(model: nn.Module, input_ids: Tensor) -> dict[str, Tensor]:
    """The attention weights of every layer (``run_with_cache(model, input_ids,
    "*.pattern")``'s dictionary) whatever the layers' backend: run them on ``"math"`` for
    this one call, and put every layer's own backend back afterwards, even on an error."""
    layers = [m for m in model.modules() if hasattr(m, "backend") and hasattr(m, "pattern")]
    before = [m.backend for m in layers]
    try:
        for m in layers:
            m.backend = "math"
        return run_with_cache(model, input_ids, "*.pattern")[1]
    finally:
        for m, backend in zip(layers, before):
            m.backend = backend
# --8<-- [end:patterns_on_any_backend]


# --8<-- [start:induction_share]
def induction_share(w: Tensor, n: int) -> Tensor:
    """On a sequence of ``n`` tokens repeated once (``2n`` positions), the weight that each
    query of the second copy (positions ``n .. 2n - 1``) puts on the token that followed its
    own token's earlier occurrence (key ``i - n + 1``), averaged over those queries:
    w ``N.. x 2n x 2n`` -> ``N..``."""
    second = torch.arange(n, 2 * n)
    return w[..., second, second - n + 1].mean(-1)
# --8<-- [end:induction_share]
