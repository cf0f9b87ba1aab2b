"""The viewer page without a browser: every value is escaped for its context, slots are
filled once, and the Content-Security-Policy names exactly the page's own script and style."""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
from dataclasses import replace
from html.parser import HTMLParser

import pytest
import torch
from hostile_strings import HOSTILE
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.analysis import capture, save_html
from attnlab.analysis.table import Table
from attnlab.analysis.viewer import viewer_data, zero_runs
from attnlab.analysis.viewer_page import html_text, render_page, script_json
from attnlab.models.decoder import DecoderLM, DecoderLMConfig

# Any code point, lone surrogates included (a file name's undecodable bytes become those).
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | ANY_TEXT
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_script_json_round_trips_and_cannot_leave_the_script(value):
    text = script_json(value)
    assert json.loads(text) == value
    assert text.isascii()  # so no U+2028 / U+2029 and no unencodable surrogate either
    assert not set("<>&") & set(text)


@settings(max_examples=300, deadline=None)
@given(ANY_TEXT)
def test_html_text_is_inert_and_reads_back(text):
    escaped = html_text(text)
    assert not set("<>\"'") & set(escaped)
    assert re.fullmatch(r"([^&]|&(amp|lt|gt|quot|#x27);)*", escaped)
    escaped.encode("utf-8")  # writable, even with a lone surrogate
    if not any(0xD800 <= ord(c) <= 0xDFFF for c in text):
        assert _Page.parse(f"<p>{escaped}</p>").text["p"] == text


@settings(max_examples=200, deadline=None)
@given(title=ANY_TEXT | st.sampled_from(HOSTILE), token=ANY_TEXT | st.sampled_from(HOSTILE))
def test_page_structure_survives_any_title_and_data(title, token):
    data = {"title": title, "tokens": [token, "__DATA__", "__TITLE__"]}
    page = _Page.parse(render_page(title, data))
    # Exactly the page's elements: nothing a value added, nothing it swallowed.
    assert page.tags == _Page.parse(render_page("t", {"tokens": []})).tags
    assert json.loads(page.text["script#data"]) == data
    if not any(0xD800 <= ord(c) <= 0xDFFF or c in "\x00\r" for c in title):
        assert page.text["title"] == page.text["h1"] == title


def test_slots_are_filled_once():
    title = "__DATA__ and __TITLE__"
    page = render_page(title, {"x": "__TITLE__"})
    assert page.count("__DATA__ and __TITLE__") == 2  # <title> and <h1>, left as they were
    assert page.count('{"x":"__TITLE__"}') == 1


def test_policy_names_the_pages_own_script_and_style_only():
    page = render_page("t", {})
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page)[1]
    csp = csp.replace("&#x27;", "'")
    assert "unsafe" not in csp and "http" not in csp and "*" not in csp
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["default-src"] == "'none'" and directives["img-src"] == "'none'"
    script = re.findall(r"<script>(.*?)</script>", page, re.S)
    style = re.findall(r"<style>(.*?)</style>", page, re.S)
    assert len(script) == len(style) == 1
    for source, name in [(script[0], "script-src"), (style[0], "style-src")]:
        digest = base64.b64encode(hashlib.sha256(source.encode()).digest()).decode()
        assert directives[name] == f"'sha256-{digest}'"


def test_save_html_writes_odd_titles_and_checks_its_arguments(tmp_path):
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.gpt(8, d_model=16, num_layers=1, num_heads=2,
                                          max_len=16)).eval()
    result = capture(model, torch.randint(0, 8, (2, 4)))
    # A file name with an undecodable byte (surrogate-escaped by Python) in the title.
    path = save_html(result, tmp_path / "a b\u202e.html", title="run\udcff: 'x'")
    page = path.read_bytes().decode("utf-8")
    assert "<title>run\\udcff: &#x27;x&#x27;</title>" in page
    with pytest.raises(ValueError, match=r"example: expected a row index in 0 \.\. 1, got 2"):
        viewer_data(result, example=2)
    with pytest.raises(ValueError, match="max_tokens: expected a positive int, got 0"):
        viewer_data(result, max_tokens=0)
    with pytest.raises(TypeError, match="title: expected a str, got int"):
        save_html(result, tmp_path / "x.html", title=3)
    with pytest.raises(TypeError, match=r"result: expected an AttentionCapture .*, got dict"):
        save_html({}, tmp_path / "x.html")
    with pytest.raises(TypeError, match=r"report: expected an attnlab\.analysis\.table\.Table"):
        save_html(result, tmp_path / "x.html", report=[["self", 0, 0]])


def test_table_cells_that_json_cannot_hold_are_text():
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.gpt(8, d_model=16, num_layers=1, num_heads=2,
                                          max_len=16)).eval()
    result = capture(model, torch.randint(0, 8, (1, 4)))
    table = Table(["kind", "layer", "head", "x"], [["self", 0, 0, float("nan")],
                                                   ["self", 0, 1, 0.12345]])
    data = viewer_data(result, report=table)
    assert data["report"]["rows"] == [["self", 0, 0, "nan"], ["self", 0, 1, 0.123]]
    json.loads(script_json(data))


class _Page(HTMLParser):
    """The element sequence of a page (``tag#id``) and the text inside each."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.text: dict[str, str] = {}
        self._open: list[str] = []

    @classmethod
    def parse(cls, page: str) -> _Page:
        parser = cls()
        parser.feed(page)
        parser.close()
        return parser

    def handle_starttag(self, tag, attrs):
        name = tag + ("#" + dict(attrs)["id"] if "id" in dict(attrs) else "")
        self.tags.append(name)
        if tag not in ("meta", "br", "img", "input"):
            self._open.append(name)
            self.text.setdefault(name, "")

    def handle_endtag(self, tag):
        self.tags.append("/" + tag)
        if self._open and self._open[-1].split("#")[0] == tag:
            self._open.pop()

    def handle_data(self, data):
        if self._open:
            self.text[self._open[-1]] += data


def test_weights_that_are_not_attention_weights_are_refused():
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.gpt(8, d_model=16, num_layers=1, num_heads=2,
                                          max_len=16)).eval()
    result = capture(model, torch.randint(0, 8, (1, 4)), tokens={"input": [[1, 2, None, 4]]})
    assert viewer_data(result)["kinds"][0]["queries"] == ["1", "2", "None", "4"]
    maps = result.maps["self"]
    for bad, message in [(float("nan"), "hold NaN or infinity"),
                         (3.5, r"lie in .* \.\. 3\.5, expected attention weights in 0 \.\. 1")]:
        w = maps.weights.clone()
        w[0, 0, 0, 1, 0] = bad
        broken = replace(result, maps={"self": replace(maps, weights=w)})
        with pytest.raises(ValueError, match="result: the 'self' weights " + message):
            viewer_data(broken)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=4)
       .filter(lambda rows: len({len(r) for r in rows}) == 1))
def test_zero_runs_decode_to_the_rows(rows):
    coded = zero_runs(torch.tensor(rows))
    for row, code in zip(rows, coded):
        decoded = []
        for v in code:
            decoded += [0] * -v if v < 0 else [v]
        assert decoded == row
        assert all(v != 0 for v in code)  # every zero is inside a run
        assert all(a >= 0 or b >= 0 for a, b in itertools.pairwise(code))  # runs are maximal


def test_zero_runs_refuses_what_it_cannot_code():
    assert zero_runs(torch.tensor([[0, 0, 5, 0], [7, 0, 0, 0]])) == [[-2, 5, -1], [7, -3]]
    for bad in [torch.tensor([[1, -2]]), torch.tensor([1, 0]), torch.tensor([[0.5]])]:
        with pytest.raises(ValueError, match=r"rows: expected a 2-d integer tensor"):
            zero_runs(bad)
