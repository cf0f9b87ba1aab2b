"""A self-contained interactive HTML view of captured attention (one file, no network).

``save_html(result, "attention.html")`` writes one HTML file with inline CSS, JavaScript
and data: pick the attention kind, the layer and a head (or all heads); hover or click a
token to see its attention lines and weights; switch to a heatmap; read the head metric
table (click a row to pick that head). To stay responsive on long inputs the weights are
rounded to 3 decimals (stored as integers in thousandths, runs of zeros coded as one negative
count: half the file for a causal model), at most ``max_tokens`` positions per axis are kept,
and at most ``max_lines`` lines are drawn per token.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from attnlab._checks import check_positive, is_int
from attnlab.analysis.capture import AttentionCapture, kind_label
from attnlab.analysis.metrics import head_report
from attnlab.analysis.table import Table
from attnlab.analysis.viewer_page import render_page

__all__ = ["save_html", "viewer_data", "zero_runs"]


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
    network: it opens from disk in any browser. Every string (title, tokens, layer and head
    names, table cells) is escaped for where it lands, so none can add markup or script.
    """
    data = viewer_data(result, example=example, report=report, title=title,
                       max_tokens=max_tokens, max_lines=max_lines)
    page = render_page(title, data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Bytes, not text: a newline translated on the way out would change the script's hash
    # that the page's Content-Security-Policy names.
    path.write_bytes(page.encode("utf-8"))
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
    """The JSON the page is built from: per kind its tokens and, per layer and head, the
    ``L x S`` weights flattened in thousandths (ints) with each run of ``m`` zeros written as
    ``-m`` (``zero_runs``), plus the metric table with numbers rounded to 3 places."""
    _check_arguments(result, example, report, title)
    check_positive("max_tokens", max_tokens)
    check_positive("max_lines", max_lines)
    if report is None:
        report = head_report(_one_example(result, example))
    kinds, truncated = [], False
    for kind, maps in result.maps.items():
        w, queries, keys = maps.example(example)
        truncated |= len(queries) > max_tokens or len(keys) > max_tokens
        w = w[..., :max_tokens, :max_tokens].float()
        _check_weights(kind, w)
        milli = torch.round(w.clamp(0, 1) * 1000).to(torch.int32)
        kinds.append({
            "kind": kind,
            "label": kind_label(kind),
            "layers": list(maps.layers),
            "heads": list(maps.heads),
            "queries": [str(t) for t in queries[:max_tokens]],
            "keys": [str(t) for t in keys[:max_tokens]],
            "weights": [zero_runs(layer) for layer in milli.flatten(2)],
        })
    rows = [[_cell(v) for v in row] for row in report.rows]
    return {
        "title": title,
        "kinds": kinds,
        "report": {"columns": report.columns, "rows": rows},
        "truncated": truncated,
        "maxTokens": max_tokens,
        "maxLines": max_lines,
    }


def zero_runs(rows: torch.Tensor) -> list[list[int]]:
    """Each row of the integer ``R x n`` tensor ``rows`` with every run of ``m`` zeros
    replaced by the single number ``-m`` (the values must be ``>= 0``)."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.is_floating_point() \
            or bool((rows < 0).any()):
        got = (f"shape {tuple(rows.shape)}, {rows.dtype}" if isinstance(rows, torch.Tensor)
               else type(rows).__name__)
        raise ValueError(f"rows: expected a 2-d integer tensor of values >= 0, got {got}")
    zero = rows == 0
    edge = torch.zeros_like(zero[..., :1])
    starts = zero & ~torch.cat([edge, zero[..., :-1]], -1)  # first zero of each run
    ends = zero & ~torch.cat([zero[..., 1:], edge], -1)  # last zero of each run
    coded = rows.clone()
    # Row-major order pairs the i-th start with the i-th end (a run never spans two rows).
    coded[starts] = (starts.nonzero()[:, -1] - ends.nonzero()[:, -1] - 1).to(rows.dtype)
    keep = ~zero | starts
    return [part.tolist() for part in coded[keep].split(keep.sum(-1).tolist())]


def _check_arguments(result: Any, example: Any, report: Any, title: Any) -> None:
    if not isinstance(result, AttentionCapture) or not result.maps:
        got = "one with no maps" if isinstance(result, AttentionCapture) else type(result).__name__
        raise TypeError(f"result: expected an AttentionCapture with at least one kind, got {got}")
    if report is not None and not isinstance(report, Table):
        raise TypeError(f"report: expected an attnlab.analysis.table.Table, got "
                        f"{type(report).__name__}")
    if not isinstance(title, str):
        raise TypeError(f"title: expected a str, got {type(title).__name__}")
    rows = min(m.weights.shape[0] for m in result.maps.values())
    if not is_int(example) or not 0 <= example < rows:
        raise ValueError(f"example: expected a row index in 0 .. {rows - 1}, got {example!r}")


def _check_weights(kind: str, w: torch.Tensor) -> None:
    """Attention weights lie in 0 .. 1; NaN would become an arbitrary integer in the page and
    logits would be drawn as if they were weights. (0.01 of slack for bfloat16 rounding.)"""
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"result: the {kind!r} weights hold NaN or infinity")
    if w.numel() and (float(w.min()) < -0.01 or float(w.max()) > 1.01):
        raise ValueError(f"result: the {kind!r} weights lie in {float(w.min()):.3g} .. "
                         f"{float(w.max()):.3g}, expected attention weights in 0 .. 1")


def _cell(v: Any) -> Any:
    """A table cell for JSON: floats rounded to 3 places; NaN and infinities (which JSON
    cannot hold) as the text Python prints for them."""
    if isinstance(v, float):
        return round(v, 3) if math.isfinite(v) else str(v)
    return v


def _one_example(result: AttentionCapture, b: int) -> AttentionCapture:
    """``result`` restricted to batch row ``b`` (for its head report)."""
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
