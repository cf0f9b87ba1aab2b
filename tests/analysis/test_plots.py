"""The PNG pictures are readable: colorbars, thinned token labels on long inputs, cell numbers
in the colour that contrasts with their cell, tokens shown as text (no mathtext)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.analysis import plots
from attnlab.analysis.plots import MAX_TICKS, text_color, tick_labels

PNG = b"\x89PNG\r\n\x1a\n"


def _luminance(rgb):  # WCAG 2 relative luminance
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb[:3]]
    return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]


def _contrast(a, b):
    hi, lo = sorted([_luminance(a), _luminance(b)], reverse=True)
    return (hi + 0.05) / (lo + 0.05)


RGB = {"black": (0.0, 0.0, 0.0), "white": (1.0, 1.0, 1.0)}


@settings(max_examples=300, deadline=None)
@given(st.tuples(*[st.floats(0, 1)] * 3))
def test_text_color_is_the_one_that_contrasts_more(rgb):
    chosen = _contrast(RGB[text_color(rgb)], rgb)
    assert chosen >= max(_contrast(RGB["black"], rgb), _contrast(RGB["white"], rgb)) - 1e-9
    assert chosen >= 4.5  # WCAG AA for text: always reachable with black or white


@pytest.fixture
def figures(monkeypatch):
    """The figures the plots would save, kept open for inspection (nothing is rendered)."""
    kept = []

    def keep(fig, path, title):
        kept.append(fig)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    yield kept
    import matplotlib.pyplot as plt

    for fig in kept:
        plt.close(fig)


def _numbers_readable(fig):
    checked = 0
    for ax in fig.axes:
        if not ax.images:
            continue
        image = ax.images[0]
        data = np.ma.filled(image.get_array(), np.nan)
        for t in ax.texts:
            j, i = (round(x) for x in t.get_position())
            r, g, b, a = image.cmap(image.norm(data[i, j]))
            cell = [a * c + (1 - a) for c in (r, g, b)]  # drawn over the white background
            assert _contrast(RGB[t.get_color()], cell) >= 4.5, (t.get_text(), cell)
            checked += 1
    return checked


def test_cell_numbers_contrast_with_their_cells(figures, tmp_path):
    torch.manual_seed(0)
    # Negative metrics (a loss change) and similarities around the old fixed threshold.
    plots.plot_metric_map(-3 * torch.rand(4, 6), tmp_path / "m.png")
    plots.plot_metric_map(torch.tensor([[0.0, 0.3, 0.55, 0.6, float("nan")]]), tmp_path / "m.png",
                          cmap="viridis")
    plots.plot_head_similarity(torch.linspace(0, 1, 36).reshape(6, 6), tmp_path / "s.png")
    plots.plot_masks(5, 3, tmp_path / "k.png")
    assert [_numbers_readable(f) for f in figures] == [24, 5, 36, 75]
    assert all(any(a.get_label() == "<colorbar>" for a in f.axes) for f in figures[:3])


def test_colorbars_say_what_their_colour_means(figures, tmp_path):
    plots.plot_metric_map(torch.rand(2, 4), tmp_path / "m.png", label="entropy (nats)")
    plots.plot_head_similarity(torch.eye(3), tmp_path / "s.png")
    plots.plot_attention_heads(torch.softmax(torch.randn(2, 3, 3), -1), "abc", "abc",
                               tmp_path / "h.png")
    labels = [next(a for a in f.axes if a.get_label() == "<colorbar>").get_ylabel()
              for f in figures]
    assert labels == ["entropy (nats)", "similarity (1 - JS / ln 2)", "attention weight"]


def test_token_labels_use_the_room_their_axis_has(figures, tmp_path):
    """A date's 30 characters (the demo's cross-attention) get labels near 8 pt, not 7; a
    short input gets 10; 40 labels or more keep the smallest readable size."""
    sizes = []
    for n in (6, 30, 130):
        tokens = [f"t{i}" for i in range(n)]
        plots.plot_attention_heads(torch.softmax(torch.randn(2, n, n), -1), tokens, tokens,
                                   tmp_path / "h.png")
        sizes.append(figures[-1].axes[0].get_yticklabels()[0].get_fontsize())
    assert sizes[0] == 10 and 8 <= sizes[1] < 10 and 6 <= sizes[2] < 7


def test_long_inputs_get_thinned_labels_a_colorbar_and_a_bounded_figure(figures, tmp_path):
    tokens = [f" word{i}" for i in range(130)]  # labels every 4th: ceil(130 / 40)
    w = torch.softmax(torch.randn(6, 130, 130), -1)
    plots.plot_attention_heads(w, tokens, tokens, tmp_path / "h.png")
    plots.plot_single_vs_multi(w[0], w[:3], tokens, tokens, tmp_path / "s.png")
    for fig in figures:
        width, height = fig.get_size_inches() * fig.dpi
        assert width <= 4000 and height <= 4000
        assert sum(a.get_label() == "<colorbar>" for a in fig.axes) == 1
        panels = [a for a in fig.axes if a.images and a.get_label() != "<colorbar>"]
        for ax in panels:
            assert len(ax.get_xticks()) <= MAX_TICKS and len(ax.get_yticks()) <= MAX_TICKS
        first = panels[0].get_yticklabels()
        assert first[0].get_text() == "0: word0" and first[1].get_text() == "4: word4"


def test_tick_labels_are_short_visible_text():
    assert tick_labels(["a", " ", "", "\n", "$x$", "x" * 30]) == (
        [0, 1, 2, 3, 4, 5], ["a", "␣", "∅", "\\n", r"\$x\$", "x" * 11 + "…"])
    positions, labels = tick_labels([str(i) for i in range(100)], max_ticks=10)
    assert positions == list(range(0, 100, 10)) and labels[3] == "30:30"


def test_tokens_with_dollars_render_as_text(tmp_path):
    w = torch.softmax(torch.randn(2, 3, 3), -1)
    tokens = ["$\\frac$", "$x$", "a$"]  # mathtext would fail on the first, typeset the second
    path = plots.plot_attention_heads(w, tokens, tokens, tmp_path / "d.png", title="cost $")
    assert path.read_bytes()[:8] == PNG
    with pytest.raises(ValueError, match=r"weights: expected a 3-d tensor, got \(3, 3\)"):
        plots.plot_attention_heads(w[0], tokens, tokens, tmp_path / "x.png")
    with pytest.raises(ValueError, match="single: expected shape 3 x 2"):
        plots.plot_single_vs_multi(w[0], w, tokens, tokens[:2], tmp_path / "x.png")


@pytest.mark.parametrize(("cols", "grid"), [(4, (2, 4)), (2, (3, 2)), (8, (1, 6))])
def test_head_grid_has_cols_panels_a_row(figures, tmp_path, cols, grid):
    w = torch.softmax(torch.randn(6, 5, 5), -1)
    plots.plot_attention_heads(w, list("abcde"), list("abcde"), tmp_path / "h.png", cols=cols)
    panels = [a for a in figures[0].axes if a.get_label() != "<colorbar>"]
    assert panels[0].get_subplotspec().get_gridspec().get_geometry() == grid
    assert sum(bool(a.images) for a in panels) == 6


@pytest.mark.parametrize("cols", [0, -1, 1.5, True, "2"])
def test_head_grid_refuses_bad_cols(tmp_path, cols):
    w = torch.softmax(torch.randn(2, 3, 3), -1)
    with pytest.raises(ValueError, match=r"cols: expected a positive int \(panels per row\)"):
        plots.plot_attention_heads(w, list("abc"), list("abc"), tmp_path / "h.png", cols=cols)
