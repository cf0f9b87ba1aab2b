"""Qwen2 speed: ours vs transformers (sdpa), prefill and decode, against the bandwidth bound.

Both float32 and bfloat16, each for one prompt and for a left-padded batch.

A random checkpoint shaped like Qwen2-0.5B with 4 layers (hidden 896, 14 query and 2
key/value heads, intermediate 4864, vocabulary 151936, tied; 196 M parameters) is written
into a temporary folder, and both models are loaded from it for each dtype
(``attnlab.bench.versus`` says what is timed and how):

- prefill: a 512-token prompt, and 8 left-padded prompts of 32 tokens at most;
- decode: 128 new tokens after a 32-token prompt, and after the 8 left-padded prompts;
- bound: decoding reads every weight once per step, so tokens/s <= rows x read bandwidth /
  weight bytes; the read bandwidth is measured (``sum`` over a 1 GiB buffer) in turns with
  each decode measure's runs;
- our bfloat16 model's next-token agreement with our float32 model on the same 128 tokens;
- with ``--quantize int8,int4``: our model with quantized weights (activations in bfloat16)
  against our bfloat16 model, the same measures, each decode against the bound of its own
  bytes, and the bytes held against float32's.

Every ratio is ours / transformers in tokens/s. Out-of-memory is recorded as ``OOM``. With
``--device cuda`` both run on the GPU (the transformers side is skipped, saying why, if it
cannot). Writes ``qwen2.md`` (the new table on top, the runs already there kept below it as
history, each with its machine), ``qwen2.json`` and ``qwen2.png``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from attnlab.bench.harness import machine_info, machine_section
from attnlab.bench.versus import (
    DTYPES,
    MEASURES,
    QWEN2_FULL,
    QWEN2_QUICK,
    Workload,
    add_workload_arguments,
    bandwidth_range,
    dtype_list,
    measure_folder,
    measure_quantized,
    median_bandwidth,
    ours_label,
    random_checkpoint,
    start_run,
)
from attnlab.bench.versus_report import plot_ratios, rate, ratio, ratio_value, share
from attnlab.durable import write_text_atomic
from attnlab.quantization import METHODS
from attnlab.quantization.formats import GROUP_SIZES

__all__ = ["add_arguments", "method_list", "run"]

def method_list(text: str) -> tuple[str, ...]:
    """``argparse`` type for comma-separated quantization methods among ``METHODS``."""
    names = tuple(x.strip() for x in text.split(","))
    if not names or len(set(names)) != len(names) or any(x not in METHODS for x in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated methods among {METHODS}, "
                                         f"each once, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m devbench qwen2``."""
    parser.add_argument("--dtypes", type=dtype_list, default=",".join(DTYPES),
                        help="comma-separated dtypes to measure, each a full set of rows")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip transformers even when it is installed")
    parser.add_argument("--quantize", type=method_list, default=(),
                        help="also measure our model with these weights (e.g. int8,int4) "
                        "against our bfloat16 model")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=64,
                        help="inputs per int4 scale and zero point")
    add_workload_arguments(parser, prefill=512, new_tokens=128, batch=8)


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark and write its files into ``args.out``; returns the markdown path."""
    sizes = QWEN2_QUICK if args.quick else QWEN2_FULL
    quick = Workload(prefill=32, prompt=8, new_tokens=16, batch=4, repeats=3)
    device, work, out, bandwidth = start_run(args, quick)
    probe = torch.randint(0, sizes["vocab_size"], (1, 128),
                          generator=torch.Generator().manual_seed(1))
    r = {"sizes": sizes, "workload": vars(work), "lengths": work.lengths(),
         "threads": torch.get_num_threads(), "device": str(device),
         "extra_memory": args.extra_memory,
         "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        _, r["checkpoint"] = random_checkpoint(tmp, "qwen2", sizes)
        for dtype in args.dtypes:
            print(f"bench qwen2: {dtype}", flush=True)
            r["runs"].append(measure_folder(tmp, dtype, device, work, probe=probe,
                                            reference=not args.no_reference,
                                            bandwidth=bandwidth,
                                            extra_memory=args.extra_memory))
        for method in args.quantize:
            print(f"bench qwen2: {method}", flush=True)
            r["quantized"] = [*r.get("quantized", []), measure_quantized(
                tmp, method, args.group_size if method == "int4" else None, device, work,
                bandwidth=bandwidth)]
    tokens = {run["dtype"]: run.get("next_tokens") for run in r["runs"]}
    if tokens.get("float32") and tokens.get("bfloat16"):
        same = [a == b for a, b in zip(tokens["float32"], tokens["bfloat16"], strict=True)]
        r["agreement"] = sum(same) / len(same)
    r["bandwidth_gbs"] = median_bandwidth(_cells(r))
    info = machine_info(device)
    r["machine"] = info
    write_text_atomic(out / "qwen2.json", json.dumps(r, indent=2))
    text = _markdown(r, info)
    md = out / "qwen2.md"
    write_text_atomic(md, text)
    groups = [f"{run['dtype']}" for run in r["runs"]]
    plot_ratios(out / "qwen2.png", f"Qwen2 (4 layers of Qwen2-0.5B's shape) on {info['cpu']}"
                if device.type == "cpu" else f"Qwen2 on {info.get('gpu', device)}", groups,
                {m: [ratio_value(run["cells"].get(m, {})) for run in r["runs"]]
                 for m in MEASURES})
    print(text)
    return md


def _markdown(r: dict, info: dict[str, str]) -> str:
    s, w = r["sizes"], r["workload"]
    reference = "; ".join(dict.fromkeys(run.get("reference", "—") for run in r["runs"]))
    where = info.get("gpu", info["cpu"]) if r["device"] != "cpu" else info["cpu"]
    lines = [
        "# Qwen2 prefill and decode, ours vs transformers",
        "",
        f"Measured on {where} ({r['device']}, {r['threads']} torch threads). Random Qwen2 "
        f"checkpoint ({r['checkpoint']}): {s['num_hidden_layers']} layers, hidden "
        f"{s['hidden_size']}, {s['num_attention_heads']} query / {s['num_key_value_heads']} "
        f"key-value heads, intermediate {s['intermediate_size']}, vocabulary "
        f"{s['vocab_size']}, tied. Reference: {reference}, loaded from the same folder. "
        f"Prefill: a {w['prefill']}-token prompt, and {w['batch']} left-padded prompts of "
        f"lengths {r['lengths']}; last-position logits. Decode: greedy, {w['new_tokens']} new "
        f"tokens after a {w['prompt']}-token prompt, and after the {w['batch']} prompts "
        f"(tokens/s over all rows). Medians of {w['repeats']} repeats, both models timed in "
        "turns. A decode step reads every weight once, so its bound is rows x read bandwidth "
        "/ weight bytes, the bandwidth (`sum` over 1 GiB) timed in turns with the cell's runs: "
        f"{bandwidth_range(_cells(r))}. "
        f"{ours_label(r.get('extra_memory', False))}. Regenerate with "
        f"`python -m devbench qwen2{' --extra-memory' if r.get('extra_memory') else ''}`.",
        "",
        "| dtype | measure | ours tokens/s | transformers tokens/s | ours / transformers "
        "| bound tokens/s | ours % of bound | transformers % of bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in r["runs"]:
        if "error" in run:
            lines.append(f"| {run['dtype']} | all | {run['error']} | — | — | — | — | — |")
            continue
        for measure, cell in run["cells"].items():
            bound = f"{cell['bound']:.1f}" if "bound" in cell else "—"
            lines.append(f"| {run['dtype']} | {measure} | {rate(cell, 'ours')} "
                         f"| {rate(cell, 'transformers')} | {ratio(cell)} | {bound} "
                         f"| {share(cell, 'ours')} | {share(cell, 'transformers')} |")
    sizes = ", ".join(f"{run['dtype']} {run['weight_bytes'] / 2**20:.0f} MiB"
                      for run in r["runs"] if "weight_bytes" in run)
    lines += ["", f"Weights read per decode step: {sizes}."]
    if "agreement" in r:
        lines.append(f"Next-token agreement of our bfloat16 and float32 models on the same "
                     f"128 tokens: {100 * r['agreement']:.1f}%.")
    lines += _quantized_markdown(r.get("quantized", []))
    lines += machine_section(info)
    return "\n".join(lines)


def _cells(r: dict) -> list[dict]:
    """Every cell of the run, the quantized ones included."""
    return [c for run in (*r["runs"], *r.get("quantized", [])) for c in run["cells"].values()]


def _quantized_markdown(runs: list[dict]) -> list[str]:
    """The quantized rows: each against our bfloat16 model, decode against its own bound."""
    if not runs:
        return []
    lines = ["", "## Quantized weights vs our bfloat16 model", "",
             "Our model loaded with `quantize=` (activations, norms and scales in bfloat16) "
             "and our bfloat16 model, both from the folder above, timed in turns. Regenerate "
             "with `python -m devbench qwen2 --quantize int8,int4`.", "",
             "| weights | measure | quantized tokens/s | bfloat16 tokens/s | quantized / "
             "bfloat16 | bound tokens/s | quantized % of bound |",
             "|---|---|---|---|---|---|---|"]
    for run in runs:
        name = run["dtype"] + (f" g{run['group_size']}" if run.get("group_size") else "")
        if "error" in run:
            lines.append(f"| {name} | all | {run['error']} | — | — | — | — |")
            continue
        for measure, cell in run["cells"].items():
            bound = f"{cell['bound']:.1f}" if "bound" in cell else "—"
            lines.append(f"| {name} | {measure} | {rate(cell, 'ours')} "
                         f"| {rate(cell, 'transformers')} | {ratio(cell)} | {bound} "
                         f"| {share(cell, 'ours')} |")
    lines.append("")
    for run in runs:
        if "held" in run:
            float32 = 2 * run["held_bfloat16"]  # every bfloat16 weight at 4 bytes
            lines.append(f"- {run['dtype']}: weights held {run['held'] / 2**20:.0f} MiB = "
                         f"{run['held'] / float32:.3f}x float32 ({float32 / 2**20:.0f} MiB); "
                         f"read per decode step {run['weight_bytes'] / 2**20:.0f} MiB.")
    return lines
