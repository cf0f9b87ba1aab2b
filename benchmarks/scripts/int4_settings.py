"""Score int4 settings of a float model against it, one setting per run, and write the table.

A developer script (issue 42, point 4), so that the int4 table of the quantization tutorial
can be reproduced on the off-grid SmolLM2 (``offgrid_smollm2.py``)::

    python benchmarks/scripts/int4_settings.py --model smol/offgrid \\
        --text benchmarks/texts/harbour.txt --calibration calibration.txt \\
        --results int4.jsonl "search g64" "gptq g64" ...
    python benchmarks/scripts/int4_settings.py --results int4.jsonl \\
        --table benchmarks/quantization-int4.md

Each setting is a copy of the float model quantized in memory (``SETTINGS``) and scored by
``attnlab.quantization.quality.measure_quality`` against the float model's logits (chunks of
512 tokens, the second half scored: llama.cpp's recipe), one JSON line appended to
``--results`` per setting (the settings are slow on a busy CPU: one process each, or
several in turns). ``--table`` writes the markdown table of every line in ``--results``.
MiB: ``weight_bytes`` (codes, scales, zeros, norms; the tied table once).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

# The layers kept in int8 by the mixed settings: as llama.cpp's Q4_K_M gives attn_v and the
# first layers' ffn_down more bits.
V_DOWN3 = ("*.v_proj", "layers.0.mlp.down_proj", "layers.1.mlp.down_proj",
           "layers.2.mlp.down_proj")
# ... and every down_proj of the first 28 layers (of SmolLM2's 30): what fits in Q4_K_M's
# 101 MiB at groups of 32.
V_DOWN28 = ("*.v_proj", *(f"layers.{i}.mlp.down_proj" for i in range(28)))
# The down_proj layers whose int4 error costs the most KL, measured one at a time on the
# off-grid SmolLM2 (each alone in int4, the rest float: layer 11 0.0196, 29 0.0109, 2 0.0035,
# 28 0.0024, 0 0.0018; the others 0.0002-0.0008): the same bytes as V_DOWN3 ...
V_DOWN_MEASURED3 = ("*.v_proj", "layers.2.mlp.down_proj", "layers.11.mlp.down_proj",
                    "layers.29.mlp.down_proj")
# ... and every down_proj but the two that cost least (layers 3 and 4): V_DOWN28's bytes.
V_DOWN_MEASURED28 = ("*.v_proj", *(f"layers.{i}.mlp.down_proj" for i in range(30)
                                   if i not in (3, 4)))


def settings(calibration: torch.Tensor | None) -> dict[str, Callable[[nn.Module], nn.Module]]:
    """Setting name -> what quantizes a copy of the float model in place."""
    from attnlab.quantization import quantize_model
    from attnlab.quantization.gptq import gptq_quantize

    def search(**kw):
        return lambda m: quantize_model(m, "int4", fit="search", **kw)

    def f16(**kw):
        return search(scale_dtype="float16", **kw)

    def gptq(**kw):
        return lambda m: gptq_quantize(m, calibration, context=512, progress=True, **kw)

    return {
        "nearest g64 f32, table int4": lambda m: quantize_model(
            m, "int4", 64, table_bits=4, fit="nearest", scale_dtype="float32", int8_layers=()),
        "search g64 f32": search(group_size=64, scale_dtype="float32", int8_layers=()),
        "search g64 f16": f16(group_size=64, int8_layers=()),
        "search g32 f16": f16(group_size=32, int8_layers=()),
        "search g64 f16 +int8 v,down0-2": f16(group_size=64, int8_layers=V_DOWN3),
        "search g32 f16 +int8 v,down0-2": f16(group_size=32, int8_layers=V_DOWN3),
        "search g32 coded": search(group_size=32, int8_layers=()),
        "search g32 coded +int8 v,down0-2": search(group_size=32, int8_layers=V_DOWN3),
        "search g32 coded +int8 v,down0,1,last": search(
            int8_layers=("*.v_proj", "layers.0.mlp.down_proj", "layers.1.mlp.down_proj",
                         "layers.{last}.mlp.down_proj")),
        "defaults: search g32 coded +int8 v,down last+outliers": search(),
        "gptq g64 f16": gptq(group_size=64, int8_layers=()),
        "gptq g32 f16": gptq(group_size=32, int8_layers=()),
        "gptq g64 f16 +int8 v,down0-2": gptq(group_size=64, int8_layers=V_DOWN3),
        "gptq g32 f16 +int8 v,down0-2": gptq(group_size=32, int8_layers=V_DOWN3),
        "gptq g32 f16 +int8 v,down0-27": gptq(group_size=32, int8_layers=V_DOWN28),
        "search g64 f16 +int8 v,down2,11,29": f16(group_size=64, int8_layers=V_DOWN_MEASURED3),
        "search g32 f16 +int8 v,down2,11,29": f16(group_size=32, int8_layers=V_DOWN_MEASURED3),
        "search g32 coded +int8 v,down2,11,29": search(group_size=32,
                                                      int8_layers=V_DOWN_MEASURED3),
        "search g32 coded +int8 v,down2,11,28": search(group_size=32, int8_layers=(
            "*.v_proj", "layers.2.mlp.down_proj", "layers.11.mlp.down_proj",
            "layers.28.mlp.down_proj")),
        "gptq g32 f16 +int8 v,down2,11,29": gptq(group_size=32, int8_layers=V_DOWN_MEASURED3),
        "gptq g32 f16 +int8 v,down but 3,4": gptq(group_size=32,
                                                   int8_layers=V_DOWN_MEASURED28),
        # every down_proj in int8 but the two of the smallest outliers: a rule, not a list,
        # at V_DOWN28's bytes
        "gptq g32 f16 +int8 v,down last+27 outliers": gptq(group_size=32, int8_outliers=27),
        "gptq defaults (g32 f16 +int8 v,down last+outliers)": gptq(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="settings to score, in turn")
    parser.add_argument("--model", type=Path, help="the float model's folder")
    parser.add_argument("--text", type=Path, help="the text scored")
    parser.add_argument("--calibration", type=Path, help="GPTQ's calibration text")
    parser.add_argument("--results", type=Path, required=True, help="JSON lines appended")
    parser.add_argument("--table", type=Path, help="markdown table of --results written")
    args = parser.parse_args()
    if args.names:
        score(args)
    if args.table:
        args.table.write_text(table(args.results), encoding="utf-8")


def score(args: argparse.Namespace) -> None:
    from attnlab.bench.quantization_model import _Cached, _ids
    from attnlab.models.io import from_pretrained
    from attnlab.quantization import weight_bytes
    from attnlab.quantization.quality import measure_quality

    ids = _ids(args.model, args.text)
    calibration = None if args.calibration is None else _ids(args.model, args.calibration)
    made = settings(calibration)
    unknown = [n for n in args.names if n not in made]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {list(made)}")
    reference = from_pretrained(args.model, kernels=False).eval()
    cached = _Cached(reference)
    measure_quality(cached, ids, context=512)
    for name in args.names:
        start = time.time()
        with torch.no_grad():
            model = made[name](copy.deepcopy(reference)).eval()
            r = measure_quality(model, ids, context=512, reference=cached)
        row = {"setting": name, "MiB": weight_bytes(model) / 2**20, "ppl": r.perplexity,
               "ref_ppl": r.reference_perplexity, "kl": r.kl_mean, "kl_p99": r.kl_p99,
               "top1": r.top1, "seconds": round(time.time() - start),
               "calibration_tokens": (calibration.numel() if calibration is not None
                                      and name.startswith("gptq") else None),
               "text": str(args.text), "tokens": ids.numel(), "cpu": platform.processor()
               or platform.machine(), "torch": torch.__version__}
        print(json.dumps(row), flush=True)
        with args.results.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        del model


def table(results: Path) -> str:
    rows = [json.loads(line) for line in results.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    lines = ["| setting | MiB | perplexity (change) | KL mean | KL p99 | top-1 | calibration "
             "tokens |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['MiB']:.1f} | {r['ppl']:.2f} "
                     f"({r['ppl'] - r['ref_ppl']:+.2f}) | {r['kl']:.4f} | {r['kl_p99']:.3f} | "
                     f"{r['top1']:.1%} | {r['calibration_tokens'] or '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
