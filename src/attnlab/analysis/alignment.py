"""Does cross-attention look where it should? Alignment of output positions with input spans.

For an encoder-decoder and pairs ``(source, target)``, a ``targets(source, target)`` function
names, for some output positions ``t`` (decoder query row ``t`` predicts target character
``t``), the source positions they should attend to (``None`` skips the pair). The result
holds, per layer and head, the **mass** (``mean_t sum_{j in targets[t]} w_tj``), the **hit
rate** (share of rows whose largest weight lies in ``targets[t]``), the uniform baseline
(``mean_t |targets[t]| / S``) and the pairwise head similarity of every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnlab.analysis.capture import capture
from attnlab.analysis.metrics import head_similarity
from attnlab.analysis.table import Table

__all__ = ["AlignmentResult", "cross_alignment"]

Targets = Callable[[str, str], "dict[int, list[int]] | None"]


@dataclass(frozen=True)
class AlignmentResult:
    """``mass``, ``hits``: ``layers x heads``; ``mean_head_mass``: ``layers`` (the mass of the
    heads' mean pattern); ``similarity``: ``layers x heads x heads`` (averaged over pairs)."""

    layers: tuple[int, ...]
    mass: Tensor
    hits: Tensor
    mean_head_mass: Tensor
    baseline: float
    similarity: Tensor
    examples: int
    skipped: int

    def table(self) -> Table:
        """One row per (layer, head): mass, hit rate and the uniform baseline."""
        t = Table(["layer", "head", "mass", "hit_rate", "baseline"])
        for i, layer in enumerate(self.layers):
            for h in range(self.mass.shape[1]):
                t.rows.append([layer, h, float(self.mass[i, h]), float(self.hits[i, h]),
                               self.baseline])
        return t

    def mean_similarity(self) -> Tensor:
        """Per layer, the mean similarity of distinct heads (1 = all heads alike)."""
        H = self.similarity.shape[-1]
        off = ~torch.eye(H, dtype=torch.bool)
        return self.similarity[:, off].mean(-1) if H > 1 else torch.ones(len(self.layers))


def cross_alignment(
    model: nn.Module,
    task: object,
    pairs: Sequence[tuple[str, str]],
    targets: Targets,
    *,
    batch_size: int = 256,
) -> AlignmentResult:
    """Measure how the cross-attention of ``model`` aligns on ``pairs`` (teacher-forced).

    ``task`` encodes pairs (``task.encode(pairs)`` -> ``src``, ``tgt_in``), as a
    ``Seq2SeqTask`` does. Raises a ``ValueError`` when no pair has targets.
    """
    kept = [(p, t) for p in pairs if (t := targets(*p))]
    if not kept:
        raise ValueError(f"pairs: none of the {len(pairs)} pairs has alignment targets")
    mass = hits = sim = None
    mean_mass, base = None, 0.0
    layers: tuple[int, ...] = ()
    for start in range(0, len(kept), batch_size):
        chunk = kept[start : start + batch_size]
        batch = task.encode([p for p, _ in chunk])  # type: ignore[attr-defined]
        maps = capture(model, batch, kinds=["cross"])["cross"]
        layers = maps.layers
        for b, (_, tgt) in enumerate(chunk):
            w, _, _ = maps.example(b)  # N x H x T x S
            rows = [r for r in tgt if r < w.shape[-2]]
            cols = torch.zeros(len(rows), w.shape[-1])
            for i, r in enumerate(rows):
                cols[i, tgt[r]] = 1.0
            sel = w[..., rows, :].float()  # N x H x R x S
            m = (sel * cols).sum(-1).mean(-1)
            top = sel.argmax(-1)  # N x H x R: each row's most attended key
            h = cols[torch.arange(len(rows)), top].mean(-1)
            mm = (sel.mean(1) * cols).sum(-1).mean(-1)
            s = torch.stack([head_similarity(layer.float()) for layer in w])
            mass = m if mass is None else mass + m
            hits = h if hits is None else hits + h
            mean_mass = mm if mean_mass is None else mean_mass + mm
            sim = s if sim is None else sim + s
            base += float((cols.sum(-1) / w.shape[-1]).mean())
    n = len(kept)
    assert mass is not None and hits is not None and mean_mass is not None and sim is not None
    return AlignmentResult(layers, mass / n, hits / n, mean_mass / n, base / n, sim / n, n,
                           len(pairs) - n)
