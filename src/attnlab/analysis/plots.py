"""Attention pictures with matplotlib (Agg), saved as PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

__all__ = ["plot_attention_heads"]


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
