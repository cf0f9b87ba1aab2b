"""One term per concept on the Japanese pages: the glossary's table of preferred terms
(``docs/glossary.ja.md``, section ``#preferred-terms``) names, for each concept, the term the
pages use and the variants they must not; no Japanese page may contain a rejected variant in
its prose (fenced code blocks and inline code are code, identical to the English pages, and
are not checked)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from page_runner import FENCE

DOCS = Path(__file__).resolve().parents[2] / "docs"
GLOSSARY = DOCS / "glossary.ja.md"
SECTION = "{#preferred-terms}"
INLINE_CODE = re.compile(r"`[^`\n]*`")
ASCII_WORD = re.compile(r"[A-Za-z0-9_]")


def japanese_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.ja.md"))


def preferred_terms(text: str) -> tuple[list[tuple[str, str, list[str], list[str]]], set[int]]:
    """The rows of the preferred-terms table as (concept, preferred term, rejected variants,
    excused words), and the table's line numbers. The variant and excused-word cells hold
    inline-code spans, one per string; the table is the first one after the heading that
    carries ``{#preferred-terms}``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith("#") and SECTION in line), None)
    if start is None:
        raise ValueError(f"the glossary has no heading with {SECTION}")
    rows, table, in_table = [], set(), False
    for number, line in enumerate(lines[start + 1:], start + 2):
        if not line.startswith("|"):
            if in_table:
                break
            if line.startswith("#"):
                break
            continue
        in_table = True
        table.add(number)
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 4:
            raise ValueError(f"a preferred-terms row needs 4 cells, got {len(cells)}: {line!r}")
        if set(cells[0]) <= set("-: ") or cells[0] == "English":
            continue  # the header and its rule
        spans = [[span.strip("`") for span in INLINE_CODE.findall(cell)] for cell in cells[2:]]
        rows.append((cells[0], cells[1], spans[0], spans[1]))
    return rows, table


def prose(text: str) -> list[tuple[int, str]]:
    """The lines of a Markdown text outside fenced blocks, with inline code blanked out (so the
    columns of a hit stay right), as (line number, text)."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is not None:
            if match and match["fence"].startswith(fence) and not match["info"].strip():
                fence = None
            continue
        if match:
            fence = match["fence"]
            continue
        lines.append((number, INLINE_CODE.sub(lambda span: " " * len(span[0]), line)))
    return lines


def variant_hits(line: str, variant: str, excused: list[str]) -> list[int]:
    """Where ``variant`` occurs in ``line``, leaving out the occurrences that overlap an
    excused word (``フォワード`` inside ``フィードフォワード``) and, for a variant that starts or
    ends with an ASCII letter or digit, those inside a longer ASCII word (``id`` in ``ids``)."""
    covered = set()
    for word in excused:
        for match in re.finditer(re.escape(word), line):
            covered.update(range(match.start(), match.end()))
    hits = []
    for match in re.finditer(re.escape(variant), line):
        start, end = match.start(), match.end()
        if covered & set(range(start, end)):
            continue
        if ASCII_WORD.match(variant[0]) and start and ASCII_WORD.match(line[start - 1]):
            continue
        if ASCII_WORD.match(variant[-1]) and end < len(line) and ASCII_WORD.match(line[end]):
            continue
        hits.append(start)
    return hits


def test_prose_skips_fenced_blocks_and_inline_code():
    text = "a `参照してよい` b\n```python\n# 参照してよい\n```\nc 参照してよい\n"
    assert prose(text) == [(1, "a " + " " * 8 + " b"), (5, "c 参照してよい")]


def test_variant_hits_excuses_overlaps_and_longer_ascii_words():
    ffn = "フィードフォワード"
    assert variant_hits(f"{ffn}とフォワード", "フォワード", [ffn]) == [10]
    assert variant_hits("テンソルの形状とテンソルの形", "の形", ["形状"]) == [12]
    assert variant_hits("ids, id と ID", "id", []) == [5]


def test_glossary_has_preferred_terms_each_with_a_rejected_variant():
    rows, _ = preferred_terms(GLOSSARY.read_text(encoding="utf-8"))
    assert len(rows) >= 8, f"only {len(rows)} rows in the glossary's preferred-terms table"
    for concept, term, rejected, _ in rows:
        assert term and rejected, f"glossary row {concept!r}: needs a term and rejected variants"
        assert not any(variant in term for variant in rejected), (
            f"glossary row {concept!r}: the preferred term {term!r} contains a rejected variant")


@pytest.mark.parametrize("page", japanese_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_japanese_page_uses_only_the_preferred_terms(page: Path):
    rows, table = preferred_terms(GLOSSARY.read_text(encoding="utf-8"))
    lines = prose(page.read_text(encoding="utf-8"))
    if page == GLOSSARY:  # the table itself names the rejected variants
        lines = [(n, line) for n, line in lines if n not in table]
    found = [
        f"{page.relative_to(DOCS)}:{n}: {variant!r} (use {term!r}, the term for {concept}): "
        f"...{line[max(0, hit - 15):hit + len(variant) + 15].strip()}..."
        for n, line in lines
        for concept, term, rejected, excused in rows
        for variant in rejected
        for hit in variant_hits(line, variant, [*excused, term])
    ]
    assert not found, "rejected variants on a Japanese page:\n" + "\n".join(found)
