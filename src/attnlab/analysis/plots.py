"""Attention pictures with matplotlib (Agg), saved as PNG: head grids, layer x head metric
maps, mask pictures, single- vs multi-head comparisons and head-similarity matrices."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "plot_attention_heads",
    "plot_head_similarity",
    "plot_masks",
    "plot_metric_map",
    "plot_single_vs_multi",
]


def plot_attention_heads(
    weights: Tensor,
    queries: Sequence[str],
    keys: Sequence[str],
    path: str | Path,
    *,
    title: str = "",
) -> Path:
    """A grid of heatmaps, one per head: weights ``H x L x S``, token labels on both axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if weights.dim() != 3 or weights.shape[1:] != (len(queries), len(keys)):
        raise ValueError(
            f"weights: expected shape H x {len(queries)} x {len(keys)}, got {tuple(weights.shape)}"
        )
    H = weights.shape[0]
    cols = min(4, H)
    rows = (H + cols - 1) // cols
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(0.32 * len(keys) * cols + 1.5, 0.32 * len(queries) * rows + 1.5),
        squeeze=False,
    )
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= H:
            ax.axis("off")
            continue
        ax.imshow(weights[h].float().cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_xticks(range(len(keys)), list(keys), fontsize=7)
        ax.set_yticks(range(len(queries)), list(queries), fontsize=7)
        ax.set_title(f"head {h}", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_metric_map(
    values: Tensor,
    path: str | Path,
    *,
    title: str = "",
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    cmap: str = "magma",
) -> Path:
    """A ``layers x heads`` map of one metric, each cell printed with its value."""
    plt = _pyplot()
    values = _check_matrix("values", values)
    N, H = values.shape
    fig, ax = plt.subplots(figsize=(0.7 * H + 2.2, 0.55 * N + 1.4))
    image = ax.imshow(values.numpy(), cmap=cmap, aspect="auto")
    fig.colorbar(image, ax=ax)
    top = float(values.max()) if values.numel() else 0.0
    for i in range(N):
        for j in range(H):
            v = float(values[i, j])
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if v > 0.6 * top else "white")
    ax.set_xticks(range(H), list(col_labels or [f"h{j}" for j in range(H)]), fontsize=8)
    ax.set_yticks(range(N), list(row_labels or [f"layer {i}" for i in range(N)]), fontsize=8)
    ax.set_xlabel("head")
    return _save(fig, path, title)


def plot_masks(length: int, valid: int, path: str | Path, *, title: str = "") -> Path:
    """The padding, look-ahead (causal) and combined masks of a ``length``-token sequence
    whose first ``valid`` tokens are real, as ``L x L`` grids with 0/1 in each cell
    (1 = may attend, rows = queries, columns = keys)."""
    from attnlab.masks import causal_mask

    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length: expected a positive int, got {length!r}")
    if not isinstance(valid, int) or not 0 <= valid <= length:
        raise ValueError(f"valid: expected an int in 0 .. {length}, got {valid!r}")
    padding = (torch.arange(length) < valid)[None, :].expand(length, length)
    causal = causal_mask(length)
    masks = [("padding", padding), ("look-ahead (causal)", causal),
             ("combined", padding & causal)]
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(3 * (0.42 * length + 1.2), 0.42 * length + 1.4))
    for ax, (name, m) in zip(axes, masks):
        ax.imshow(m.int().numpy(), cmap="Blues", vmin=0, vmax=1.4)
        for i in range(length):
            for j in range(length):
                ax.text(j, i, str(int(m[i, j])), ha="center", va="center", fontsize=8)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(length))
        ax.set_yticks(range(length))
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    return _save(fig, path, title or f"masks, length {length}, {valid} real tokens")


def plot_single_vs_multi(
    single: Tensor,
    multi: Tensor,
    queries: Sequence[str],
    keys: Sequence[str],
    path: str | Path,
    *,
    title: str = "",
) -> Path:
    """Left: one single-head pattern ``L x S``; right: the ``H`` heads ``H x L x S`` of a
    multi-head layer and their mean, with token labels."""
    single = _check_matrix("single", single)
    if multi.dim() != 3 or tuple(multi.shape[1:]) != tuple(single.shape):
        raise ValueError(f"multi: expected shape H x {tuple(single.shape)}, got "
                         f"{tuple(multi.shape)}")
    panels = [("single head", single), *((f"head {h}", m) for h, m in enumerate(multi.float())),
              ("mean of heads", multi.float().mean(0))]
    plt = _pyplot()
    cols = min(5, len(panels))
    rows = (len(panels) + cols - 1) // cols
    size = 0.3 * max(len(keys), len(queries)) + 1.4
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    for i, ax in enumerate(axes.flat):
        if i >= len(panels):
            ax.axis("off")
            continue
        name, w = panels[i]
        ax.imshow(w.cpu().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_xticks(range(len(keys)), list(keys), fontsize=6)
        ax.set_yticks(range(len(queries)), list(queries), fontsize=6)
        ax.set_title(name, fontsize=8, color="crimson" if i == 0 else "black")
    return _save(fig, path, title or "single-head vs multi-head attention")


def plot_head_similarity(
    similarity: Tensor, path: str | Path, *, labels: Sequence[str] | None = None, title: str = ""
) -> Path:
    """The ``H x H`` Jensen-Shannon head similarity (``metrics.head_similarity``) with values."""
    sim = _check_matrix("similarity", similarity)
    H = sim.shape[0]
    labels = list(labels or [f"h{i}" for i in range(H)])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(0.55 * H + 2.4, 0.55 * H + 1.6))
    image = ax.imshow(sim.numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax)
    for i in range(H):
        for j in range(H):
            ax.text(j, i, f"{float(sim[i, j]):.2f}", ha="center", va="center", fontsize=6,
                    color="black" if sim[i, j] > 0.6 else "white")
    ax.set_xticks(range(H), labels, fontsize=7, rotation=90)
    ax.set_yticks(range(H), labels, fontsize=7)
    return _save(fig, path, title or "head similarity (1 - JS / ln 2)")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _check_matrix(name: str, x: Tensor) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != 2:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a 2-d tensor, got {got}")
    return x.detach().float().cpu()


def _save(fig, path: str | Path, title: str) -> Path:
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
