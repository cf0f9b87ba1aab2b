"""Kernel tests run with a cache folder of their own, no forced kernel from the shell, and
no timings remembered from another test."""

from __future__ import annotations

import pytest

from attnlab.kernels import calibration


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """``$ATTNLAB_CACHE_DIR`` set to a fresh folder; ``$ATTNLAB_KERNELS`` unset."""
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    monkeypatch.setattr(calibration, "_TIMINGS", {})
    return tmp_path / "cache" / "kernels.json"
