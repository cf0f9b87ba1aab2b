"""The Japanese pages' figures: the docs hook ``docs_hooks/cjk_font.py`` gives matplotlib a
font with Japanese glyphs (IPAexGothic, from the docs dependency ``matplotlib-fontja``) after
DejaVu Sans, so Japanese labels are drawn, not replaced by empty boxes, and Latin text keeps
its font."""

from __future__ import annotations

import importlib.util
import io
import warnings
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

HOOK = Path(__file__).resolve().parents[2] / "docs_hooks" / "cjk_font.py"


def test_japanese_figure_text_is_drawn_with_a_japanese_font():
    spec = importlib.util.spec_from_file_location("cjk_font", HOOK)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    before = matplotlib.rcParams["font.family"]
    try:
        hook.on_config(None)
        assert matplotlib.rcParams["font.family"] == ["DejaVu Sans", "IPAexGothic"]
        fig, ax = plt.subplots()
        ax.set_title("ヘッド 0 のアテンション重み (layer 1)")
        svg = io.StringIO()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*Glyph.*missing")
            fig.savefig(svg, format="svg")
        plt.close(fig)
    finally:
        matplotlib.rcParams["font.family"] = before
    text = svg.getvalue()
    assert "IPAexGothic" in text and "DejaVuSans" in text, "expected glyphs from both fonts"
