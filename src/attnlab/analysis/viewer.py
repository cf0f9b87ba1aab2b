"""A self-contained interactive HTML view of captured attention (one file, no network).

``save_html(result, "attention.html")`` writes one HTML file with inline CSS, JavaScript
and data: pick the attention kind, the layer and a head (or all heads); hover or click a
token to see its attention lines and weights; switch to a heatmap; read the head metric
table (click a row to pick that head). To stay responsive on long inputs the weights are
rounded to 3 decimals (stored as integers in thousandths), at most ``max_tokens`` positions
per axis are kept, and at most ``max_lines`` lines are drawn per token.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import torch

from attnlab.analysis.capture import AttentionCapture, kind_label
from attnlab.analysis.metrics import head_report
from attnlab.analysis.table import Table
from attnlab.analysis.viewer_page import PAGE

__all__ = ["save_html", "viewer_data"]


def save_html(
    result: AttentionCapture,
    path: str | Path,
    *,
    example: int = 0,
    report: Table | None = None,
    title: str = "Attention viewer",
    max_tokens: int = 256,
    max_lines: int = 40,
) -> Path:
    """Write the viewer for row ``example`` of ``result`` to ``path``; returns the path.

    ``report`` defaults to ``head_report`` of that row. Nothing in the file loads from a
    network: it opens from disk in any browser.
    """
    data = viewer_data(result, example=example, report=report, title=title,
                       max_tokens=max_tokens, max_lines=max_lines)
    # "</" inside the JSON could close the <script> element early.
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")
    page = PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", payload)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def viewer_data(
    result: AttentionCapture,
    *,
    example: int = 0,
    report: Table | None = None,
    title: str = "Attention viewer",
    max_tokens: int = 256,
    max_lines: int = 40,
) -> dict[str, Any]:
    """The JSON the page is built from: per kind its tokens and ``layer x head x L x S``
    weights in thousandths (ints), plus the metric table with numbers rounded to 3 places."""
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected a positive int, got {max_tokens!r}")
    if not isinstance(max_lines, int) or max_lines < 1:
        raise ValueError(f"max_lines: expected a positive int, got {max_lines!r}")
    if report is None:
        report = head_report(_one_example(result, example))
    kinds, truncated = [], False
    for kind, maps in result.maps.items():
        w, queries, keys = maps.example(example)
        truncated |= len(queries) > max_tokens or len(keys) > max_tokens
        w = w[..., :max_tokens, :max_tokens]
        milli = torch.round(w.float() * 1000).to(torch.int32)
        kinds.append({
            "kind": kind,
            "label": kind_label(kind),
            "layers": list(maps.layers),
            "heads": list(maps.heads),
            "queries": queries[:max_tokens],
            "keys": keys[:max_tokens],
            "weights": milli.reshape(*milli.shape[:2], -1).tolist(),
        })
    rows = [[round(v, 3) if isinstance(v, float) else v for v in row] for row in report.rows]
    return {
        "title": title,
        "kinds": kinds,
        "report": {"columns": report.columns, "rows": rows},
        "truncated": truncated,
        "maxTokens": max_tokens,
        "maxLines": max_lines,
    }


def _one_example(result: AttentionCapture, b: int) -> AttentionCapture:
    """``result`` restricted to batch row ``b`` (for its head report)."""
    from dataclasses import replace

    maps = {
        k: replace(
            m,
            weights=m.weights[b : b + 1],
            query_tokens=m.query_tokens[b : b + 1],
            key_tokens=m.key_tokens[b : b + 1],
            query_mask=m.query_mask[b : b + 1],
            key_mask=m.key_mask[b : b + 1],
        )
        for k, m in result.maps.items()
    }
    return AttentionCapture(maps, None)
