"""The viewer's page: HTML, CSS and JavaScript in one file, and how values are put into it.

``render_page(title, data)`` fills the page's two slots, each escaped for its context: the
title as HTML text, the data as JSON inside a ``<script type="application/json">``. The slots
are filled in one pass, so a value that contains a slot's name is never filled again. The
page's Content-Security-Policy loads nothing (no network, no images) and runs only the page's
own script and style, named by their SHA-256: an injected inline handler or script is inert.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import re
from typing import Any

__all__ = ["html_text", "render_page", "script_json"]


def render_page(title: str, data: Any) -> str:
    """The complete HTML page showing ``data`` (JSON-serialisable) under ``title``."""
    if not isinstance(title, str):
        raise TypeError(f"title: expected a str, got {type(title).__name__}")
    values = {"TITLE": html_text(title), "DATA": script_json(data)}
    return _SLOT.sub(lambda m: values[m[1]], _TEMPLATE)


def html_text(text: str) -> str:
    """``text`` escaped for HTML text and quoted attribute values (``& < > " '``).

    A lone surrogate (an undecodable byte of a file name) cannot be written as UTF-8; it is
    spelled out as ``\\udcXX`` instead of failing the write.
    """
    return html.escape(text.encode("utf-8", "backslashreplace").decode("utf-8"), quote=True)


def script_json(value: Any) -> str:
    """``value`` as JSON that is safe inside a ``<script>`` element of an HTML page.

    The text is ASCII (``ensure_ascii``; U+2028 and U+2029, which end a JavaScript line,
    become ``\\u`` escapes too) and has no ``<``, ``>`` or ``&``: no ``</script>``, no
    ``<!--`` that would switch the HTML parser into a state where ``</script>`` no longer
    closes the element. ``json.loads`` of the result gives ``value`` back.
    """
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    # These characters occur only inside JSON strings, where a \u escape means the same.
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _csp_hash(source: str) -> str:
    digest = hashlib.sha256(source.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


_STYLE = r"""
body { font: 14px system-ui, sans-serif; margin: 12px 18px; color: #222; }
h1 { font-size: 18px; margin: 0 0 8px; }
.bar { display: flex; gap: 14px; align-items: center; flex-wrap: wrap; margin: 6px 0; }
button { font: inherit; padding: 2px 8px; border: 1px solid #999; background: #f4f4f4;
         border-radius: 4px; cursor: pointer; }
button.on { background: #2a6fdb; color: white; border-color: #2a6fdb; }
#status { font-weight: 600; }
#info { min-height: 1.4em; font-family: ui-monospace, monospace; white-space: pre-wrap;
        background: #f7f7f0; padding: 4px 8px; border-radius: 4px; }
#notice { color: #a33; }
#lines-view { overflow: auto; max-height: 70vh; border: 1px solid #ddd; }
svg text.tok { font: 13px ui-monospace, monospace; cursor: pointer; }
svg text.tok.sel { fill: #d33; font-weight: 700; }
svg text.w { font: 11px ui-monospace, monospace; fill: #555; }
#heatmap-view { overflow: auto; max-height: 75vh; border: 1px solid #ddd; display: flex;
                align-items: flex-start; gap: 8px; }
#heatmap-view.hidden { display: none; }
table { border-collapse: collapse; margin-top: 10px; font-size: 12px; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
tr.sel td { background: #ffe9a8; }
tbody tr { cursor: pointer; }
.hidden { display: none; }
"""

_SCRIPT = r"""
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const S = {kind: 0, layer: 0, head: 0, view: "lines", pinned: null};
const NS = "http://www.w3.org/2000/svg";
const ROW = 18, COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
  "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const $ = (id) => document.getElementById(id);
const rowY = (j) => 30 + j * ROW;  // the baseline of token j in the lines view
const K = () => D.kinds[S.kind];
const headName = () => (S.head < 0 ? "all heads (their mean; " + K().heads.length +
  " heads)" : "head " + K().heads[S.head]);

// How a token is drawn: blank and control characters would be invisible or break the line,
// so they show as symbols (a Map, so that "__proto__" or "constructor" is just a token).
const PICTURES = new Map([["", "\u2205"], [" ", "\u2423"], ["\n", "\u21b5"], ["\t", "\u21e5"]]);
const shown = (t) => PICTURES.get(t) ?? t.replace(/[\x00-\x1f\x7f]/g,
  (c) => String.fromCharCode(c === "\x7f" ? 0x2421 : 0x2400 + c.charCodeAt(0)));
// A token quoted in the info line; bidi controls are spelled out, or an RTL override in one
// token would reverse the rest of the line.
const quote = (t) => JSON.stringify(t).replace(/[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g,
  (c) => "\\u" + c.charCodeAt(0).toString(16).padStart(4, "0"));

function el(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// Weights of one head (or the mean of all heads) as a flat L*S array of floats.
const memo = new Map();
function weights(head) {
  const key = S.kind + "/" + S.layer + "/" + head;
  if (!memo.has(key)) memo.set(key, meanOf(head));
  return memo.get(key);
}

function meanOf(head) {
  const k = K(), n = k.queries.length * k.keys.length, out = new Float32Array(n);
  if (head >= 0) {  // thousandths with zeros run-length coded: -m stands for m zeros
    let i = 0;
    for (const v of k.weights[S.layer][head]) { if (v < 0) i -= v; else out[i++] = v / 1000; }
    return out;
  }
  const ws = k.heads.map((_, h) => weights(h));
  for (const w of ws) for (let i = 0; i < n; i++) out[i] += w[i] / ws.length;
  return out;
}

// The (other index, weight) pairs of token i on side "q" (a row) or "k" (a column).
function pairs(w, side, i) {
  const L = K().queries.length, Sn = K().keys.length, out = [];
  if (side === "q") for (let j = 0; j < Sn; j++) out.push([j, w[i * Sn + j]]);
  else for (let j = 0; j < L; j++) out.push([j, w[j * Sn + i]]);
  return out.sort((a, b) => b[1] - a[1]);
}

function fillSelects() {
  $("kind").replaceChildren(...D.kinds.map((k, i) => new Option(k.label, i)));
  $("kind").value = S.kind;
  $("layer").replaceChildren(...K().layers.map((l, i) => new Option(String(l), i)));
  $("layer").value = S.layer;
  const btns = K().heads.map((h, i) => button("head-" + h, String(h), () => setHead(i)));
  $("heads").replaceChildren(...btns, button("head-all", "all", () => setHead(-1)));
}

function button(id, text, onclick) {
  const b = document.createElement("button");
  b.id = id; b.textContent = text; b.onclick = onclick;
  return b;
}

function setHead(i) { S.head = i; render(); }

function render() {
  const k = K();
  // Buttons are found by position: a head named "all" must not light up the "all" button.
  const on = S.head < 0 ? k.heads.length : S.head;
  [...$("heads").children].forEach((b, i) => b.classList.toggle("on", i === on));
  $("status").textContent = k.label + " · layer " + k.layers[S.layer] + " · " + headName();
  $("notice").textContent = D.truncated ? "long input: only the first " + D.maxTokens +
    " positions are shown" : "";
  $("view-lines").classList.toggle("on", S.view === "lines");
  $("view-heatmap").classList.toggle("on", S.view === "heatmap");
  $("lines-view").classList.toggle("hidden", S.view !== "lines");
  $("heatmap-view").classList.toggle("hidden", S.view !== "heatmap");
  if (S.view === "lines") drawTokens(); else drawHeatmap();
  drawTable();
  // The info line always describes what is selected now, never a head picked before.
  if (S.pinned) showToken(S.pinned.side, S.pinned.i);
  else $("info").textContent = (S.view === "lines" ? "Hover or click a token" :
    "Hover a cell") + " · " + headName();
}

function drawTokens() {
  const k = K(), svg = $("lines");
  const n = Math.max(k.queries.length, k.keys.length);
  svg.setAttribute("width", 640); svg.setAttribute("height", n * ROW + 30);
  svg.replaceChildren(el("g", {id: "links"}));
  svg.append(el("text", {x: 150, y: 14, "text-anchor": "end", class: "w"}, "queries"),
             el("text", {x: 470, y: 14, class: "w"}, "keys"));
  const add = (side, toks, x, anchor) => toks.forEach((t, i) => {
    const e = el("text", {x, y: rowY(i) + 4, "text-anchor": anchor, class: "tok",
                          id: side + "-" + i}, shown(t));
    e.addEventListener("mouseenter", () => { if (!S.pinned) showToken(side, i); });
    e.addEventListener("click", () => {
      const same = S.pinned && S.pinned.side === side && S.pinned.i === i;
      S.pinned = same ? null : {side, i}; showToken(side, i);
    });
    svg.append(e);
  });
  add("q", k.queries, 150, "end");
  add("k", k.keys, 470, "start");
  if (!S.pinned) drawOverview();
}

// Before a token is picked: the strongest links of the whole pattern, faint, so that its
// shape shows at a glance (at most maxLines of them).
function drawOverview() {
  const k = K(), w = weights(S.head), Sn = k.keys.length, top = [];
  for (let n = 0; n < w.length; n++) if (w[n] >= 0.05) top.push([n, w[n]]);
  top.sort((a, b) => b[1] - a[1]);
  for (const [n, v] of top.slice(0, D.maxLines)) {
    $("links").append(el("line", {x1: 156, y1: rowY(Math.floor(n / Sn)), x2: 464,
      y2: rowY(n % Sn),
      class: "link overview", stroke: "#2a6fdb", "stroke-opacity": 0.08 + 0.5 * v,
      "stroke-width": 0.5 + 2 * v}));
  }
}

function showToken(side, i) {
  const k = K(), other = side === "q" ? "k" : "q";
  const toks = side === "q" ? k.queries : k.keys, otoks = side === "q" ? k.keys : k.queries;
  document.querySelectorAll("text.tok.sel").forEach((e) => e.classList.remove("sel"));
  const self = $(side + "-" + i);
  if (self) self.classList.add("sel");
  const links = $("links");
  if (links) {
    links.replaceChildren();
    document.querySelectorAll("text.w.val").forEach((e) => e.remove());
    const heads = S.head < 0 ? k.heads.map((_, h) => h) : [S.head];
    const budget = Math.max(1, Math.floor(D.maxLines / heads.length));
    heads.forEach((h, hi) => {
      const top = pairs(weights(h), side, i).filter((p) => p[1] >= 0.005).slice(0, budget);
      for (const [j, v] of top) {
        const [yq, yk] = side === "q" ? [rowY(i), rowY(j)] : [rowY(j), rowY(i)];
        links.append(el("line", {x1: 156, y1: yq, x2: 464, y2: yk, class: "link",
          stroke: S.head < 0 ? COLORS[hi % COLORS.length] : "#2a6fdb",
          "stroke-opacity": Math.min(1, 0.15 + v), "stroke-width": 0.5 + 4 * v}));
      }
    });
    const mean = pairs(weights(S.head), side, i).slice(0, D.maxLines);
    for (const [j, v] of mean) {
      if (v < 0.005) continue;
      const x = side === "q" ? 560 : 80;
      $("lines").append(el("text", {x, y: rowY(j) + 4, class: "w val", "text-anchor": "end"},
                           v.toFixed(3)));
    }
  }
  const best = pairs(weights(S.head), side, i).filter((p, n) => n === 0 || p[1] >= 0.0005)
    .slice(0, 5)
    .map(([j, v]) => quote(otoks[j]) + "(" + j + ") " + v.toFixed(3)).join("  ");
  $("info").textContent = (side === "q" ? "query " : "key ") + quote(toks[i]) +
    " (" + i + ") · " + headName() + (side === "q" ? " → " : " ← ") + best;
}

function color(v) {  // white -> blue -> dark blue
  const c = v < 0.5 ? [255 - 2 * v * 213, 255 - 2 * v * 144, 255 - 2 * v * 36]
                    : [42 - (v - 0.5) * 60, 111 - (v - 0.5) * 160, 219 - (v - 0.5) * 200];
  return "rgb(" + c.map((x) => Math.round(Math.max(0, x))).join(",") + ")";
}

function drawHeatmap() {
  const k = K(), w = weights(S.head), L = k.queries.length, Sn = k.keys.length;
  const cell = Math.max(2, Math.min(22, Math.floor(900 / Math.max(L, Sn))));
  const pad = cell >= 10 ? 70 : 4, cv = $("heatmap"), ctx = cv.getContext("2d");
  cv.width = pad + Sn * cell + 4; cv.height = pad + L * cell + 4;
  ctx.fillStyle = "white"; ctx.fillRect(0, 0, cv.width, cv.height);
  for (let i = 0; i < L; i++) for (let j = 0; j < Sn; j++) {
    ctx.fillStyle = color(w[i * Sn + j]); ctx.fillRect(pad + j * cell, pad + i * cell, cell, cell);
  }
  if (pad > 4) {
    ctx.fillStyle = "#222"; ctx.font = Math.min(12, cell - 2) + "px monospace";
    k.queries.forEach((t, i) => ctx.fillText(label(t), 2, pad + i * cell + cell - 3));
    k.keys.forEach((t, j) => { ctx.save(); ctx.translate(pad + j * cell + cell - 3, pad - 3);
      ctx.rotate(-Math.PI / 2); ctx.fillText(label(t), 0, 0); ctx.restore(); });
  }
  drawScale(cv.height);
  cv.onmousemove = (ev) => {
    const r = cv.getBoundingClientRect();
    const j = Math.floor((ev.clientX - r.left - pad) / cell);
    const i = Math.floor((ev.clientY - r.top - pad) / cell);
    if (i < 0 || j < 0 || i >= L || j >= Sn) return;
    $("info").textContent = "query " + quote(k.queries[i]) + " (" + i + ") → key " +
      quote(k.keys[j]) + " (" + j + ") · " + headName() + ": " +
      w[i * Sn + j].toFixed(3);
  };
}

// The colour scale beside the heatmap: weight 0 (white) at the bottom to 1 at the top.
function drawScale(height) {
  const cv = $("scale"), ctx = cv.getContext("2d"), top = 24, bar = Math.max(60, height - 40);
  cv.width = 70; cv.height = top + bar + 12;
  ctx.fillStyle = "white"; ctx.fillRect(0, 0, cv.width, cv.height);
  for (let y = 0; y < bar; y++) {
    ctx.fillStyle = color(1 - y / (bar - 1)); ctx.fillRect(6, top + y, 16, 1);
  }
  ctx.strokeStyle = "#999"; ctx.strokeRect(5.5, top - 0.5, 17, bar + 1);
  ctx.fillStyle = "#222"; ctx.font = "11px monospace";
  ctx.fillText("weight", 2, 12);
  for (const v of [1, 0.5, 0]) ctx.fillText(v.toFixed(1), 27, top + (1 - v) * (bar - 1) + 4);
}

// At most 8 characters (code points, so that no emoji is cut in half) of a heatmap label.
const label = (t) => Array.from(shown(t)).slice(0, 8).join("");

function drawTable() {
  const cols = D.report.columns, k = K();
  $("metrics").tHead.replaceChildren(row(cols, "th"));
  const body = $("metrics").tBodies[0];
  body.replaceChildren();
  const ki = cols.indexOf("kind"), li = cols.indexOf("layer"), hi = cols.indexOf("head");
  // A table without kind, layer and head columns is shown whole, its rows not tied to heads.
  const tied = ki >= 0 && li >= 0 && hi >= 0;
  for (const r of D.report.rows) {
    if (tied && (r[ki] !== k.kind || r[li] !== k.layers[S.layer])) continue;
    const tr = row(r.map((v) => (typeof v === "number" && !Number.isInteger(v) ?
      v.toFixed(3) : String(v))), "td");
    const h = tied ? k.heads.indexOf(r[hi]) : -1;
    if (h >= 0) {  // a row of a head that was not captured picks nothing
      tr.id = "metric-head-" + r[hi];
      if (h === S.head) tr.classList.add("sel");
      tr.onclick = () => setHead(h);
    }
    body.append(tr);
  }
}

function row(cells, tag) {
  const tr = document.createElement("tr");
  for (const c of cells) { const td = document.createElement(tag); td.textContent = c;
    tr.append(td); }
  return tr;
}

$("kind").onchange = () => { S.kind = +$("kind").value; S.layer = 0; S.head = 0;
  S.pinned = null; fillSelects(); render(); };
$("layer").onchange = () => { S.layer = +$("layer").value; render(); };
$("view-lines").onclick = () => { S.view = "lines"; render(); };
$("view-heatmap").onclick = () => { S.view = "heatmap"; render(); };
fillSelects();
render();
document.body.dataset.ready = "1";
"""

_CSP = (
    "default-src 'none'; "
    f"script-src {_csp_hash(_SCRIPT)}; style-src {_csp_hash(_STYLE)}; "
    "img-src 'none'; base-uri 'none'; form-action 'none'"
)

_SLOT = re.compile(r"__(TITLE|DATA)__")

_TEMPLATE = (
    """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
"""
    + '<meta http-equiv="Content-Security-Policy" content="' + html.escape(_CSP) + '">'
    + """
<title>__TITLE__</title>
<style>""" + _STYLE + """</style>
</head>
<body>
<h1>__TITLE__</h1>
<div class="bar">
  <label>attention <select id="kind"></select></label>
  <label>layer <select id="layer"></select></label>
  <span>head <span id="heads"></span></span>
  <span>view <button id="view-lines" class="on">lines</button>
  <button id="view-heatmap">heatmap</button></span>
</div>
<div class="bar"><span id="status"></span><span id="notice"></span></div>
<div id="info">Hover or click a token.</div>
<div id="lines-view"><svg id="lines" xmlns="http://www.w3.org/2000/svg"></svg></div>
<div id="heatmap-view" class="hidden"><canvas id="heatmap"></canvas>
<canvas id="scale"></canvas></div>
<table id="metrics"><thead></thead><tbody></tbody></table>
<script id="data" type="application/json">__DATA__</script>
<script>""" + _SCRIPT + """</script>
</body>
</html>
"""
)
