"""Japanese glyphs for the figures that the pages draw while the site builds.

The Japanese pages draw their figures with Japanese titles and labels, and matplotlib's
default font (DejaVu Sans) has no Japanese glyphs: they would come out as empty boxes. The
docs dependency ``matplotlib-fontja`` ships IPAexGothic; this hook registers that font file
with matplotlib and makes it the fallback family after DejaVu Sans, so that Latin text looks as
it always did and each Japanese character is drawn from IPAexGothic (matplotlib picks a
glyph's font per character since 3.6).

The package is found without importing it: its import sets IPAexGothic as the only family,
which would change every English figure too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import matplotlib
from matplotlib import font_manager

PACKAGE = "matplotlib-fontja"
FONT_FILE = Path("fonts") / "ipaexg.ttf"


def on_config(config):
    spec = importlib.util.find_spec(PACKAGE.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the docs need the package {PACKAGE} (a Japanese font for the figures of the "
            f"Japanese pages): pip install -e '.[docs]'")
    font = Path(spec.submodule_search_locations[0]) / FONT_FILE
    font_manager.fontManager.addfont(str(font))
    family = font_manager.FontProperties(fname=str(font)).get_name()
    matplotlib.rcParams["font.family"] = ["DejaVu Sans", family]
    return config
