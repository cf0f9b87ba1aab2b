"""Table cells and the ratio plot of the ours-vs-transformers benchmarks (``bench.versus``).

A cell is one measure of ``versus.compare``: tokens/s of ``"ours"`` and ``"transformers"``
(``None`` with an ``*_error`` such as ``"OOM"``, or no reference), and for decoding the
bandwidth ``bound``. The ratio is ours / transformers in tokens/s: above 1x we are faster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_ratios", "rate", "ratio", "ratio_value", "share"]

WHO = ("ours", "transformers")


def rate(cell: dict[str, Any], who: str) -> str:
    """Tokens/s of ``who`` (``"ours"`` or ``"transformers"``), its error, or ``—``."""
    value = cell.get(who)
    if value is None:
        return cell.get(f"{who}_error") or "—"
    return f"{value:.1f}"


def ratio_value(cell: dict[str, Any]) -> float | None:
    """ours / transformers tokens/s, or None when either is missing."""
    ours, ref = cell.get("ours"), cell.get("transformers")
    return None if ours is None or not ref else ours / ref


def ratio(cell: dict[str, Any]) -> str:
    """``ratio_value`` as ``1.23x``, or ``—``."""
    value = ratio_value(cell)
    return "—" if value is None else f"{value:.2f}x"


def share(cell: dict[str, Any], who: str) -> str:
    """``who``'s decode rate as a percentage of the bandwidth bound, or ``—``."""
    value, bound = cell.get(who), cell.get("bound")
    return "—" if value is None or not bound else f"{100 * value / bound:.0f}%"


def plot_ratios(path: Path, title: str, groups: list[str],
                ratios: dict[str, list[float | None]]) -> None:
    """Grouped bars: for each group (a family and dtype, say) one bar per measure, its
    ours / transformers ratio; a line at 1x. A missing ratio leaves its bar out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(groups) + 2), 4.5))
    width = 0.8 / max(1, len(ratios))
    for k, (measure, values) in enumerate(ratios.items()):
        xs = [i + (k - (len(ratios) - 1) / 2) * width for i, v in enumerate(values)
              if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=measure)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    ax.set_ylabel("ours / transformers tokens/s (above 1: faster)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
