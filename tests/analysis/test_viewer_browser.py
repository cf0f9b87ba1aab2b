"""The HTML viewer opened in headless Chromium: pick a head, click a token, read the page."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch
from hostile_strings import HOSTILE

from attnlab.analysis import capture, save_html
from attnlab.analysis.table import Table
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.transformer import Transformer, TransformerConfig

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Every wait on the page: a hang guard, far above its time on a busy 2-core machine.
HANG_MS = 600_000
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install chromium)"
)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the playwright package is not installed (dev extra)"
    )
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


def _open(browser, path):
    page = browser.new_page()
    page.set_default_timeout(HANG_MS)
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    # An alert, confirm or prompt means a script of the data ran: record it as an error.
    page.on("dialog", lambda d: (errors.append("dialog: " + d.message), d.dismiss()))
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='1']")
    return page, requests, errors


def test_viewer_head_and_token_clicks(browser, tmp_path):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab_size=30, tgt_vocab_size=30, d_model=32,
                                          num_heads=4, num_encoder_layers=2,
                                          num_decoder_layers=2, d_ff=64, dropout=0.0)).eval()
    src_text, tgt_text = "abc</d", "xyz"
    src = torch.tensor([[4 + i for i in range(len(src_text))]])
    tgt = torch.tensor([[1, 10, 11, 12]])
    result = capture(model, (src, tgt),
                     tokens={"src": [list(src_text)], "tgt": [["<bos>", *tgt_text]]})
    path = save_html(result, tmp_path / "view.html", title="tiny <model>")
    page, requests, errors = _open(browser, path)

    assert page.title() == "tiny <model>"
    kinds = page.eval_on_selector_all("#kind option", "os => os.map(o => o.textContent)")
    assert kinds == ["encoder self-attention", "decoder self-attention", "cross-attention"]
    page.select_option("#kind", label="cross-attention")
    page.select_option("#layer", label="1")
    page.click("#head-2")
    assert page.inner_text("#status") == "cross-attention · layer 1 · head 2"
    assert page.get_attribute("#head-2", "class") == "on"
    # The metric table shows this kind and layer, with head 2's row highlighted.
    assert page.locator("#metrics tbody tr").count() == 4
    assert page.get_attribute("#metric-head-2", "class") == "sel"

    # Before any token is picked, the head's strongest links are drawn faintly.
    overview = page.locator("#links line.overview").count()
    assert 1 <= overview <= len(src_text) * len(src_text)
    page.click("#q-3")  # the query "z": its top key and weight, as Python computes them
    assert page.locator("#links line.overview").count() == 0
    w = result["cross"].weights[0, 1, 2, 3]
    j = int(w.argmax())
    info = page.inner_text("#info")
    assert info.startswith('query "z" (3) · head 2 → ')
    assert f'"{src_text[j]}"({j}) {w[j]:.3f}' in info
    lines = page.locator("#links line").count()
    assert 1 <= lines <= len(src_text)
    labels = page.eval_on_selector_all("text.w.val", "es => es.map(e => e.textContent)")
    assert f"{w[j]:.3f}" in labels

    page.click("#head-all")
    assert page.inner_text("#status").endswith("all heads (their mean; 4 heads)")
    mean = result["cross"].weights[0, 1, :, 3].mean(0)
    assert f"{mean.max():.3f}" in page.inner_text("#info")

    page.click("#metric-head-1")  # a table row picks its head
    assert page.inner_text("#status").endswith("head 1")

    page.click("#view-heatmap")
    assert page.is_visible("#heatmap") and not page.is_visible("#lines")
    box = page.locator("#heatmap").bounding_box()
    assert box["width"] > 50
    # The colour scale beside it: the top of the bar is weight 1, its middle weight 0.5.
    assert page.is_visible("#scale")
    pixel = ("([x, y]) => Array.from(document.getElementById('scale').getContext('2d')"
             ".getImageData(x, y, 1, 1).data.slice(0, 3))")
    height = page.eval_on_selector("#scale", "c => c.height")
    bar = height - 24 - 12
    assert page.evaluate(pixel, [14, 24]) == [12, 31, 119]
    assert page.evaluate(pixel, [14, 24 + (bar - 1) // 2]) == pytest.approx([42, 111, 219], abs=4)
    assert errors == []
    assert all(url.startswith("file://") for url in requests), requests
    page.close()


def test_viewer_long_input_stays_responsive(browser, tmp_path):
    """Responsive by construction, asserted by counts, not by a time: what is drawn is capped
    (the first 200 positions, at most 20 lines)."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(50, d_model=32, num_layers=1, num_heads=4,
                                            num_kv_heads=2, max_len=700)).eval()
    ids = torch.randint(0, 50, (1, 600))
    result = capture(model, ids)
    path = save_html(result, tmp_path / "long.html", max_tokens=200, max_lines=20)
    assert path.stat().st_size < 280_000  # zero runs coded: 205 KB (360 KB written out)
    page, requests, errors = _open(browser, path)
    assert "only the first 200 positions" in page.inner_text("#notice")
    assert page.locator("text.tok").count() == 400
    assert 1 <= page.locator("#links line.overview").count() <= 20
    page.click("#head-all")
    page.click("#q-150")
    assert page.locator("#links line").count() <= 20
    page.click("#view-heatmap")
    assert page.is_visible("#heatmap")
    assert errors == [] and all(u.startswith("file://") for u in requests)
    page.close()




def _hostile_capture(tokens):
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.gpt(8, d_model=16, num_layers=1, num_heads=2,
                                          max_len=32)).eval()
    ids = torch.randint(0, 8, (1, len(tokens)))
    return capture(model, ids, tokens={"input": [tokens]})


def test_viewer_hostile_strings_stay_text(browser, tmp_path):
    tokens = [*HOSTILE, "", " ", "\n", "__proto__"]
    result = _hostile_capture(tokens)
    maps = result.maps["self"]
    # Layer and head names reach the page too (selects, buttons, status, table).
    named = replace(maps, layers=("<img src=x onerror=alert(6)>",),
                    heads=("__DATA__", "</script><b>h</b>"))
    result = replace(result, maps={"self": named})
    # Four titles here (each a page load); test_viewer_escaping checks all of them without a
    # browser.
    for title in HOSTILE[:3] + HOSTILE[6:7]:
        path = save_html(result, tmp_path / "hostile.html", title=title)
        page, requests, errors = _open(browser, path)
        assert page.title() == title
        assert page.inner_text("h1") == title
        shown = page.eval_on_selector_all("text.tok", "es => es.map(e => e.textContent)")
        assert len(shown) == 2 * len(tokens)
        for t, s in zip(tokens, shown):
            assert s == {"": "∅", " ": "␣", "\n": "↵", "x\x00y": "x\u2400y"}.get(t, t)
        assert page.inner_text("#layer") == "<img src=x onerror=alert(6)>"
        assert page.eval_on_selector_all("#heads button", "bs => bs.map(b => b.textContent)") \
            == ["__DATA__", "</script><b>h</b>", "all"]
        page.click("#heads button >> nth=1")
        assert page.inner_text("#status").endswith("head </script><b>h</b>")
        page.click("#q-7")  # the RTL override is shown escaped, not applied to the line
        assert "\\u202e" in page.inner_text("#info") and "\u202e" not in page.inner_text("#info")
        page.click("#view-heatmap")
        assert page.locator("img, iframe, svg svg, b").count() == 0
        assert errors == []
        assert all(u.startswith("file://") for u in requests), requests
        page.close()


def test_viewer_policy_blocks_injected_handlers(browser, tmp_path):
    """Were markup ever injected, the page's CSP still forbids inline handlers and loads."""
    result = _hostile_capture(list("abc"))
    path = save_html(result, tmp_path / "view.html")
    text = path.read_text().replace(
        "<body>", "<body><img id=bad src=x onerror=\"document.body.dataset.pwned=1\">"
        "<script>document.body.dataset.pwned=2</script>", 1)
    path.write_text(text)
    page, requests, _ = _open(browser, path)
    assert page.get_attribute("body", "data-ready") == "1"  # the page's own script runs
    assert page.get_attribute("body", "data-pwned") is None
    assert all(u.startswith("file://") for u in requests), requests
    page.close()


def test_viewer_shows_a_table_without_head_columns_whole(browser, tmp_path):
    result = _hostile_capture(list("abc"))
    report = Table(["name", "score"], [["first", 0.12345], ["<i>second</i>", float("inf")]])
    path = save_html(result, tmp_path / "view.html", report=report)
    page, _, errors = _open(browser, path)
    cells = page.eval_on_selector_all("#metrics tbody td", "ts => ts.map(t => t.textContent)")
    assert cells == ["first", "0.123", "<i>second</i>", "inf"]
    page.click("#head-1")
    assert page.locator("#metrics tbody tr").count() == 2 and errors == []
    page.close()


def test_viewer_info_line_follows_the_selected_head(browser, tmp_path):
    """After "all", nothing on the page still describes the head picked before."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(50, d_model=32, num_layers=1, num_heads=4,
                                            num_kv_heads=2)).eval()
    path = save_html(capture(model, torch.randint(0, 50, (1, 6))), tmp_path / "v.html")
    page, _, errors = _open(browser, path)
    page.click("#head-2")
    page.click("#view-heatmap")
    page.hover("#heatmap", position={"x": 80, "y": 80})
    assert "head 2:" in page.inner_text("#info")
    page.click("#head-all")
    for where in ("#status", "#info"):
        text = page.inner_text(where)
        assert "head 2" not in text and text.endswith("all heads (their mean; 4 heads)"), text
    page.click("#view-lines")
    assert page.inner_text("#info") == "Hover or click a token · all heads (their mean; 4 heads)"
    assert errors == []
    page.close()
