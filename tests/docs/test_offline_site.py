"""The built site works with no network: the configuration keeps every asset local, and the
checker that `.ci/run` runs on the built site catches a page that asks the network."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_config_keeps_fonts_and_the_search_shim_local():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["theme"]["font"] is False  # Material's default is Google Fonts
    shims = [p for p in config["extra"]["polyfills"] if "iframe-worker" in p]
    # The offline plugin adds its CDN copy unless a polyfill named iframe-worker is listed.
    assert shims and all((ROOT / "docs" / p).is_file() for p in shims), shims
    scripts = config["extra_javascript"] + config["extra_css"] + config["extra"]["polyfills"]
    assert not [s for s in scripts if "://" in s]


@pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser")),
                    reason="no chromium on PATH (.ci/run installs it and fails without it)")
def test_the_offline_check_reports_requests_that_leave_the_site(tmp_path: Path):
    offline_site = pytest.importorskip("offline_site")
    site = tmp_path / "site"
    (site / "sub").mkdir(parents=True)
    (site / "local.js").write_text("document.title = 'local ran';")
    (site / "index.html").write_text(
        '<html><head><script src="local.js"></script></head><body>home</body></html>')
    (site / "broken.html").write_text('<html><head><script src="gone.js"></script></head></html>')
    (site / "sub" / "page.html").write_text(
        '<html><head><link rel="stylesheet" href="https://fonts.googleapis.com/css?family=R">'
        '<script src="../../outside.js"></script></head><body>page</body></html>')
    (tmp_path / "outside.js").write_text("")
    problems = offline_site.check_site(site, searches={})
    assert sorted(problems) == sorted([
        f"broken.html: asks for a file the site lacks, {(site / 'gone.js').as_uri()}",
        "sub/page.html: asks for https://fonts.googleapis.com/css?family=R",
        f"sub/page.html: asks for {(tmp_path / 'outside.js').as_uri()}",
    ]), problems
    assert offline_site.check_site(site, pages=["index.html"], searches={}) == []
