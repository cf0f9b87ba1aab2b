"""Drawing one token from next-token logits: attnlab's ``sample_logits`` against what
``transformers``' ``generate(do_sample=True)`` runs each step, in the same process.

The reference is transformers' logits warpers (``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, in its order), a softmax and ``torch.multinomial``.
attnlab draws by inverse CDF (one uniform a row) and looks for top-p's nucleus among the 1024
highest-ranked tokens before sorting all ``V``. Both give the same distribution
(``tests/generation/test_sampling.py`` proves ours against the formula). Vocabularies of
Llama 2 (32000) and Qwen2 (151936), one row (decoding) and 16 rows (a serving batch), four
settings: plain temperature, top-p, Qwen2.5-Instruct's defaults (top-k 20 + top-p 0.8) and
transformers' default top-k 50. Writes ``sampling.md`` (earlier runs kept as history) and
``sampling.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from attnlab.arg_types import positive_int
from attnlab.bench.harness import machine_info, machine_section, time_medians
from attnlab.durable import write_text_atomic
from attnlab.generation import sample_logits

__all__ = ["add_arguments", "run"]

# (name, temperature, top_k, top_p)
SETTINGS = (
    ("T=1", 1.0, None, None),
    ("T=0.7, top-p 0.8", 0.7, None, 0.8),
    ("T=0.7, top-k 20, top-p 0.8", 0.7, 20, 0.8),
    ("T=0.7, top-k 50", 0.7, 50, None),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m devbench sampling``."""
    parser.add_argument("--repeats", type=positive_int, default=21,
                        help="timed runs per cell (median)")


def run(args: argparse.Namespace) -> Path:
    """Time both samplers on every (vocabulary, rows, setting) cell; write the results into
    ``args.out``; returns the markdown path."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    shapes = ((1, 32000), (1, 151936), (16, 151936)) if not args.quick else ((1, 32000),)
    repeats = 3 if args.quick else args.repeats
    generator = torch.Generator().manual_seed(0)
    rows = []
    cells = [(shape, setting) for shape in shapes for setting in SETTINGS]
    for (B, V), (name, temperature, top_k, top_p) in tqdm(cells, desc="bench sampling",
                                                           unit="cell"):
        logits = torch.randn(B, V, generator=generator) * 3
        warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
        if top_k is not None:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p is not None:
            warpers.append(TopPLogitsWarper(top_p))
        ids = torch.zeros(B, 1, dtype=torch.long)

        def ours(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p):
            return sample_logits(logits, temperature, top_k, top_p, generator, check=False)

        def reference(logits=logits, warpers=warpers, ids=ids):
            probs = torch.softmax(warpers(ids, logits.clone()), dim=-1)
            return torch.multinomial(probs, 1, generator=generator)

        times = time_medians({"ours": ours, "reference": reference}, repeats=repeats)
        rows.append({"rows": B, "vocab": V, "setting": name, "ours_ms": times["ours"] * 1e3,
                     "reference_ms": times["reference"] * 1e3})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    write_text_atomic(out / "sampling.json", json.dumps({"rows": rows, "machine": info}, indent=2))
    text = _markdown(rows, info)
    md = out / "sampling.md"
    write_text_atomic(md, text)
    print(text)
    return md


def _markdown(rows: list[dict], info: dict[str, str]) -> str:
    lines = ["# Sampling a token: attnlab vs transformers", "",
             "One draw from logits `B x V` (median ms of repeats, both in the same run): "
             "attnlab's `sample_logits` against transformers' warpers + softmax + "
             "`torch.multinomial`. `speed-up` = transformers / attnlab.", "",
             "| B | V | setting | attnlab ms | transformers ms | speed-up |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rows']} | {r['vocab']} | {r['setting']} | {r['ours_ms']:.2f} | "
                     f"{r['reference_ms']:.2f} | {r['reference_ms'] / r['ours_ms']:.1f}x |")
    return "\n".join(lines + machine_section(info))
