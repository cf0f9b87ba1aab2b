"""Attention pictures with matplotlib (Agg), saved as PNG: head grids, layer x head metric
maps, mask pictures, single- vs multi-head comparisons and head-similarity matrices.

Every heatmap has a colorbar that says what its colour means. Long inputs stay readable: a
panel grows with the number of tokens only up to a cap, at most ``MAX_TICKS`` token labels are
written per axis (every k-th, prefixed with its position), in the largest size that the room
along the axis allows, and a label is cut to ``MAX_LABEL`` characters. Numbers
written in cells are black or white, whichever contrasts more with the cell's colour.
Tokens and titles are shown as text, never as matplotlib mathtext (``$`` stays a dollar).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from attnlab._checks import is_int
from attnlab.masks import causal_mask

__all__ = [
    "MAX_LABEL",
    "MAX_TICKS",
    "plot_attention_heads",
    "plot_head_similarity",
    "plot_masks",
    "plot_metric_map",
    "plot_single_vs_multi",
    "text_color",
    "tick_labels",
]

MAX_TICKS = 40  # token labels per axis at most
MAX_LABEL = 12  # characters per token label at most
MAX_NUMBERS = 32  # cells per axis at most for numbers to be written in them
_PANEL_MAX = 7.0  # inches: the largest side of one heatmap panel
_EQUAL_CONTRAST = math.sqrt(1.05 * 0.05) - 0.05  # the luminance where black = white (0.179)


def plot_attention_heads(
    weights: Tensor,
    queries: Sequence[str],
    keys: Sequence[str],
    path: str | Path,
    *,
    title: str = "",
    cols: int = 4,
) -> Path:
    """A grid of heatmaps, one per head, ``cols`` to a row: weights ``H x L x S``, token labels
    on both axes (thinned on long inputs), one colorbar for the grid (weights 0 .. 1)."""
    if not is_int(cols) or cols < 1:
        raise ValueError(f"cols: expected a positive int (panels per row), got {cols!r}")
    weights = _check_tensor("weights", weights, 3)
    if weights.shape[1:] != (len(queries), len(keys)):
        raise ValueError(
            f"weights: expected shape H x {len(queries)} x {len(keys)}, got {tuple(weights.shape)}"
        )
    H = weights.shape[0]
    if min(weights.shape) == 0:
        raise ValueError(f"weights: expected at least one head, query and key, got shape "
                         f"{tuple(weights.shape)}")
    panels = [(f"head {h}", weights[h]) for h in range(H)]
    return _heatmap_grid(panels, queries, keys, path, cols=cols, title=title)


def plot_metric_map(
    values: Tensor,
    path: str | Path,
    *,
    title: str = "",
    row_labels: Sequence[str] | None = None,
    col_labels: Sequence[str] | None = None,
    cmap: str = "magma",
    label: str = "",
) -> Path:
    """A ``layers x heads`` map of one metric with a colorbar (titled ``label``: the metric
    and its unit, e.g. ``"entropy (nats)"``), each cell printed with its value (up to
    ``MAX_NUMBERS`` cells per axis)."""
    values = _check_tensor("values", values, 2)
    N, H = values.shape
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(min(0.7 * H, 20) + 2.2, min(0.55 * N, 16) + 1.4),
                           layout="constrained")
    image = ax.imshow(values.numpy(), cmap=cmap, aspect="auto")
    fig.colorbar(image, ax=ax, label=label)
    _write_numbers(ax, image, values, "{:.2f}", fontsize=7)
    cols = list(col_labels or [f"h{j}" for j in range(H)])
    rows = list(row_labels or [f"layer {i}" for i in range(N)])
    _set_ticks(ax.set_xticks, cols, fontsize=8)
    _set_ticks(ax.set_yticks, rows, fontsize=8)
    ax.set_xlabel("head")
    return _save(fig, path, title)


def plot_masks(length: int, valid: int, path: str | Path, *, title: str = "") -> Path:
    """The padding, look-ahead (causal) and combined masks of a ``length``-token sequence
    whose first ``valid`` tokens are real, as ``L x L`` grids with 0/1 in each cell
    (1 = may attend, rows = queries, columns = keys)."""
    if not is_int(length) or length < 1:
        raise ValueError(f"length: expected a positive int, got {length!r}")
    if not is_int(valid) or not 0 <= valid <= length:
        raise ValueError(f"valid: expected an int in 0 .. {length}, got {valid!r}")
    padding = (torch.arange(length) < valid)[None, :].expand(length, length)
    causal = causal_mask(length)
    masks = [("padding", padding), ("look-ahead (causal)", causal),
             ("combined", padding & causal)]
    plt = _pyplot()
    side = _panel_inches(length)
    fig, axes = plt.subplots(1, 3, figsize=(3 * side, side + 0.6), layout="constrained")
    positions = [str(i) for i in range(length)]
    for ax, (name, m) in zip(axes, masks):
        image = ax.imshow(m.int().numpy(), cmap="Blues", vmin=0, vmax=1.4)
        _write_numbers(ax, image, m.int(), "{:.0f}", fontsize=8)
        ax.set_title(name, fontsize=9)
        _set_ticks(ax.set_xticks, positions, fontsize=7)
        _set_ticks(ax.set_yticks, positions, fontsize=7)
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
    multi-head layer and their mean, with token labels and one colorbar."""
    single = _check_tensor("single", single, 2)
    if single.shape != (len(queries), len(keys)):
        raise ValueError(f"single: expected shape {len(queries)} x {len(keys)}, got "
                         f"{tuple(single.shape)}")
    multi = _check_tensor("multi", multi, 3)
    if tuple(multi.shape[1:]) != tuple(single.shape):
        raise ValueError(f"multi: expected shape H x {tuple(single.shape)}, got "
                         f"{tuple(multi.shape)}")
    panels = [("single head", single), *((f"head {h}", m) for h, m in enumerate(multi)),
              ("mean of heads", multi.mean(0))]
    return _heatmap_grid(panels, queries, keys, path, cols=5,
                         title=title or "single-head vs multi-head attention", first="crimson")


def plot_head_similarity(
    similarity: Tensor, path: str | Path, *, labels: Sequence[str] | None = None, title: str = ""
) -> Path:
    """The ``H x H`` Jensen-Shannon head similarity (``metrics.head_similarity``) with a
    colorbar and the values (up to ``MAX_NUMBERS`` heads)."""
    sim = _check_tensor("similarity", similarity, 2)
    H = sim.shape[0]
    labels = list(labels or [f"h{i}" for i in range(H)])
    plt = _pyplot()
    side = min(0.55 * H, 16)
    fig, ax = plt.subplots(figsize=(side + 2.4, side + 1.6), layout="constrained")
    image = ax.imshow(sim.numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, label="similarity (1 - JS / ln 2)")
    _write_numbers(ax, image, sim, "{:.2f}", fontsize=7)
    _set_ticks(ax.set_xticks, labels, fontsize=7, rotation=90)
    _set_ticks(ax.set_yticks, labels, fontsize=7)
    return _save(fig, path, title or "head similarity (1 - JS / ln 2)")


def tick_labels(tokens: Sequence[str], max_ticks: int = MAX_TICKS) -> tuple[list[int], list[str]]:
    """``(positions, labels)`` for an axis of ``tokens``: all of them when there are at most
    ``max_ticks``, else every k-th written as ``"position:token"`` so that a reader can
    still place it. Each label is cut to ``MAX_LABEL`` characters, blank and control
    characters are made visible and ``$`` is escaped from mathtext."""
    n = len(tokens)
    step = max(1, math.ceil(n / max_ticks))
    positions = list(range(0, n, step))
    labels = [_label(str(tokens[i])) for i in positions]
    if step > 1:
        labels = [f"{i}:{label}" for i, label in zip(positions, labels)]
    return positions, labels


def text_color(rgba: Sequence[float]) -> str:
    """``"black"`` or ``"white"``: whichever contrasts more with a cell of colour ``rgba``
    (WCAG relative luminance ``Y``: the contrast with black is ``(Y + 0.05) / 0.05``, with
    white ``1.05 / (Y + 0.05)``; they are equal at ``Y = sqrt(1.05 * 0.05) - 0.05``)."""
    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(float(c)) for c in rgba[:3])
    return "black" if 0.2126 * r + 0.7152 * g + 0.0722 * b > _EQUAL_CONTRAST else "white"


def _heatmap_grid(panels, queries, keys, path, *, cols, title, first=None) -> Path:
    plt = _pyplot()
    cols = min(cols, len(panels))
    rows = (len(panels) + cols - 1) // cols
    width, height = _panel_inches(len(keys)), _panel_inches(len(queries))
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols + 1.2, height * rows + 0.8),
                             squeeze=False, layout="constrained")
    xs, ys = tick_labels(keys), tick_labels(queries)
    fontsize = _tick_fontsize(max(len(keys), len(queries)))
    image = None
    for i, ax in enumerate(axes.flat):
        if i >= len(panels):
            ax.axis("off")
            continue
        name, w = panels[i]
        image = ax.imshow(w.numpy(), cmap="viridis", vmin=0.0, vmax=1.0,
                          aspect="auto", interpolation="nearest")
        ax.set_xticks(*xs, fontsize=fontsize, rotation=90)
        ax.set_yticks(*ys, fontsize=fontsize)
        # Labels on the outer panels only (the axes are shared): half the clutter, and on
        # long inputs most of the drawing time.
        ax.tick_params(labelleft=i % cols == 0, labelbottom=i + cols >= len(panels))
        ax.set_title(name, fontsize=8, color=first if i == 0 and first else "black")
    fig.colorbar(image, ax=axes, shrink=min(1.0, 0.9 / rows + 0.1), label="attention weight")
    return _save(fig, path, title)


def _tick_fontsize(n: int) -> float:
    """The token labels' size in points on a panel of ``n`` tokens: 0.6 of the room that one
    label gets along its axis (72 points an inch), between 6 (40 or more labels) and 10."""
    shown = min(n, MAX_TICKS)
    room = 72 * (_panel_inches(n) - 1.2) / max(shown, 1)
    return max(6.0, min(10.0, round(0.6 * room, 1)))


def _panel_inches(n: int) -> float:
    """One panel's side for ``n`` tokens: 0.32 in. a token plus room for labels, capped."""
    return min(0.32 * n, _PANEL_MAX - 1.2) + 1.2


def _label(token: str) -> str:
    shown = token
    if _odd(token):
        shown = {"": "∅", " ": "␣"}.get(token) or repr(token)[1:-1]
    if len(shown) > MAX_LABEL:
        shown = shown[: MAX_LABEL - 1] + "…"
    return _no_math(shown)


def _odd(token: str) -> bool:
    """Blank, or holding characters that a label would hide (controls, line breaks)."""
    return not token.strip() or not token.isprintable()


def _no_math(text: str) -> str:
    # matplotlib reads $...$ as mathtext: a token "$x$" would be typeset, "$\frac" would fail.
    return text.replace("$", r"\$")


def _set_ticks(setter, labels: Sequence[str], **kwargs) -> None:
    positions, shown = tick_labels([str(x) for x in labels])
    if len(positions) == len(labels):  # short axes: the labels as given
        shown = [_no_math(str(x)) for x in labels]
    setter(positions, shown, **kwargs)


def _write_numbers(ax, image, values: Tensor, fmt: str, *, fontsize: int) -> None:
    if max(values.shape) > MAX_NUMBERS:  # unreadably small; the colorbar tells the value
        return
    colors = image.cmap(image.norm(values.float().numpy()))
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            v = float(values[i, j])
            # A NaN cell is left blank (the white background shows): black text there.
            color = text_color(colors[i, j]) if math.isfinite(v) else "black"
            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=fontsize,
                    color=color)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _check_tensor(name: str, x: Tensor, dims: int) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != dims:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected a {dims}-d tensor, got {got}")
    return x.detach().float().cpu()


def _save(fig, path: str | Path, title: str) -> Path:
    if title:
        fig.suptitle(_no_math(title), fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
