"""Every model family: ours vs transformers (sdpa), prefill and decode tokens/s.

Both float32 and bfloat16, each for one prompt and for a left-padded batch.

For each family that ``attnlab.models.families.FAMILIES`` reads, a random checkpoint of
realistic per-layer width (hidden 1024, 16 query / 4 key-value heads of 64, intermediate
2816, or GPT-2's 4096) but only 4 layers and a vocabulary of 8192, so that the run stays
short, is written into a temporary folder; both models are loaded from it for each dtype and
timed as ``attnlab.bench.versus`` says (prefill: a 256-token prompt and 4 left-padded ones of
32 tokens at most; decode: 32 new tokens after them). Every ratio is ours / transformers in
tokens/s; decode also against the bandwidth bound (rows x read bandwidth / weight bytes).
With ``--model FOLDER`` (repeatable) the checkpoints a user has on disk are measured
instead, one row per folder and dtype, each folder's own ``config.json`` saying its family and
sizes (read as ``from_pretrained`` reads it, so an unsupported one is refused before any
timing). Out-of-memory is recorded as ``OOM``. Writes ``families.md``,
``families.json`` and ``families.png`` (``python -m devbench families`` keeps the earlier runs
of a committed table below the new one).
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path

import torch

from attnlab.bench.harness import (
    BandwidthProbe,
    machine_info,
    machine_section,
)
from attnlab.bench.versus import (
    DTYPES,
    MEASURES,
    Workload,
    add_workload_arguments,
    bandwidth_range,
    dtype_list,
    measure_folder,
    median_bandwidth,
    ours_label,
    random_checkpoint,
    start_run,
)
from attnlab.bench.versus_report import plot_ratios, rate, ratio, ratio_value, share
from attnlab.durable import write_text_atomic
from attnlab.models import DecoderLMConfig
from attnlab.models.families import FAMILIES
from attnlab.models.families.loading import read_config

__all__ = ["FULL", "QUICK", "add_arguments", "family_list", "model_folder", "run"]

FULL = {"vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 64, "max_position_embeddings": 2048}
QUICK = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 256}


def family_list(text: str) -> tuple[str, ...]:
    """``argparse`` type for comma-separated ``model_type`` names that ``FAMILIES`` reads."""
    names = tuple(x.strip() for x in text.split(","))
    wrong = [x for x in names if x not in FAMILIES]
    if wrong or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated model types among "
                                         f"{sorted(FAMILIES)}, each once, got {text!r}")
    return names


def model_folder(text: str) -> str:
    """``argparse`` type for a checkpoint folder whose ``config.json`` attnlab reads (the
    family from its ``model_type``); the folder as given."""
    try:
        read_config(text)
    except (OSError, TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``attnlab bench families``."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--families", type=family_list, default=None,
                       help=f"comma-separated model types, each a random checkpoint (default: "
                       f"one of each family: {', '.join(_one_per_family())})")
    which.add_argument("--model", type=model_folder, action="append", default=None,
                       metavar="FOLDER", help="a checkpoint folder on disk (as `attnlab "
                       "generate --model`) to measure instead of the random ones; repeatable")
    parser.add_argument("--dtypes", type=dtype_list, default=",".join(DTYPES),
                        help="comma-separated dtypes to measure")
    add_workload_arguments(parser, prefill=256, new_tokens=32, batch=4)


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark and write its files into ``args.out``; returns the markdown path."""
    sizes = QUICK if args.quick else FULL
    quick = Workload(prefill=16, prompt=6, new_tokens=4, batch=2, repeats=1)
    device, work, out, bandwidth = start_run(args, quick)
    r = {"sizes": None if args.model else sizes, "workload": vars(work), "lengths": work.lengths(),
         "threads": torch.get_num_threads(), "device": str(device),
         "extra_memory": args.extra_memory}
    if args.model:
        configs = [(folder, read_config(folder)[1]) for folder in args.model]
        for folder, config in configs:  # every limit checked before any is timed
            _check_positions(folder, config.max_len, work)
        r["folders"] = True
        r["families"] = [_measure_model(folder, config, args.dtypes, device, work, bandwidth,
                                        args.extra_memory) for folder, config in configs]
    else:
        r["families"] = [_measure_random(model_type, sizes, args.dtypes, device, work,
                                         bandwidth, args.extra_memory)
                         for model_type in args.families or _one_per_family()]
    r["bandwidth_gbs"] = median_bandwidth(_cells(r))
    info = machine_info(device)
    r["machine"] = info
    write_text_atomic(out / "families.json", json.dumps(r, indent=2))
    text = _markdown(r, info)
    md = out / "families.md"
    write_text_atomic(md, text)
    pairs = [(_label(f, r).replace("`", ""), run) for f in r["families"] for run in f["runs"]]
    plot_ratios(out / "families.png",
                f"Families, ours vs transformers, on {info.get('gpu', info['cpu'])}",
                [f"{name} {run['dtype']}" for name, run in pairs],
                {m: [ratio_value(run["cells"].get(m, {})) for _, run in pairs]
                 for m in MEASURES})
    print(text)
    return md


def _measure_random(model_type: str, sizes: dict, dtypes: tuple[str, ...],
                    device: torch.device, work: Workload, bandwidth: BandwidthProbe,
                    extra_memory: bool) -> dict:
    """A random checkpoint of ``model_type`` (``sizes``) written into a temporary folder and
    measured in each dtype: its row group of the table."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _, written_by = random_checkpoint(tmp, model_type, sizes)
        except (ValueError, TypeError) as error:  # without transformers: Llama's keys
            written_by = f"none: {error}"
            runs = [{"dtype": d, "error": "no checkpoint", "cells": {}} for d in dtypes]
        else:
            runs = []
            for dtype in dtypes:
                print(f"bench families: {model_type} {dtype}", flush=True)
                runs.append(measure_folder(tmp, dtype, device, work, bandwidth=bandwidth,
                                           extra_memory=extra_memory))
    return {"model_type": model_type, "checkpoint": written_by, "runs": runs}


def _measure_model(folder: str, config: DecoderLMConfig, dtypes: tuple[str, ...],
                   device: torch.device, work: Workload, bandwidth: BandwidthProbe,
                   extra_memory: bool) -> dict:
    """One ``--model`` folder (``config`` read from it) measured in each dtype: its row group
    of the table, with what its ``config.json`` says of it."""
    runs = []
    for dtype in dtypes:
        print(f"bench families: {folder} {dtype}", flush=True)
        runs.append(measure_folder(folder, dtype, device, work, bandwidth=bandwidth,
                                   extra_memory=extra_memory))
    return {"model_type": config.family, "checkpoint": str(folder),
            "sizes": f"{config.num_layers} layers, hidden {config.d_model}, "
                     f"{config.num_heads} query / {config.num_kv_heads or config.num_heads} "
                     f"key-value heads, vocabulary {config.vocab_size}",
            "runs": runs}


def _check_positions(folder: str, limit: int, work: Workload) -> None:
    """A ``ValueError`` naming the options when the workload needs more positions than the
    ``limit`` of the model at ``folder``."""
    longest = max(work.prefill, work.prompt + work.new_tokens)
    if longest > limit:
        raise ValueError(f"--prefill, --prompt, --new-tokens: the workload needs {longest} "
                         f"positions, more than the {limit} of {folder} "
                         "(its config.json's limit)")


def _one_per_family() -> list[str]:
    """The first ``model_type`` of each family in ``FAMILIES``."""
    first: dict[str, str] = {}
    for model_type, family in FAMILIES.items():
        first.setdefault(family.name, model_type)
    return list(first.values())


def _cells(r: dict) -> list[dict]:
    """Every cell of every family's runs."""
    return [c for f in r["families"] for run in f["runs"] for c in run["cells"].values()]


def _markdown(r: dict, info: dict[str, str]) -> str:
    s, w = r["sizes"], r["workload"]
    where = info.get("gpu", info["cpu"]) if r["device"] != "cpu" else info["cpu"]
    references = {run.get("reference") for f in r["families"] for run in f["runs"]}
    head = " | ".join(f"{m} ours / transformers tokens/s | {m} ratio" for m in MEASURES)
    if r.get("folders"):
        checkpoints = "The checkpoints given: " + "; ".join(
            f"`{f['checkpoint']}` ({f['model_type']}: {f['sizes']})" for f in r["families"]) + "."
        options = "".join(f" --model {shlex.quote(f['checkpoint'])}" for f in r["families"])
    else:
        checkpoints = (
            f"One random checkpoint per family: {s['num_hidden_layers']} layers, hidden "
            f"{s['hidden_size']}, {s['num_attention_heads']} query / "
            f"{s['num_key_value_heads']} key-value heads of {s['head_dim']} (where the family "
            f"has GQA), intermediate {s['intermediate_size']} (GPT-2: 4 x hidden), vocabulary "
            f"{s['vocab_size']}; the family's own norms, MLP, positions and tying.")
        options = ""
    lines = [
        "# Model families, ours vs transformers",
        "",
        f"Measured on {where} ({r['device']}, {r['threads']} torch threads). {checkpoints} "
        f"Reference: {'; '.join(sorted(x for x in references if x))}, "
        f"loaded from the same folder. Prefill: a {w['prefill']}-token prompt, and "
        f"{w['batch']} left-padded prompts of lengths {r['lengths']}. Decode: greedy, "
        f"{w['new_tokens']} new tokens after a {w['prompt']}-token prompt and after the "
        f"{w['batch']} prompts (tokens/s over all rows). Medians of {w['repeats']} repeats, "
        f"both models timed in turns. Ratio: ours / transformers tokens/s. Bound: rows x read "
        "bandwidth / weight bytes, the bandwidth (`sum` over 1 GiB) timed in turns with each "
        f"decode cell's runs: {bandwidth_range(_cells(r))}. "
        f"{ours_label(r.get('extra_memory', False))}. Regenerate with "
        f"`attnlab bench families{options}{' --extra-memory' if r.get('extra_memory') else ''}`.",
        "",
        f"| family | dtype | {head} | decode % of bound, ours / transformers "
        "| decode batched % of bound, ours / transformers |",
        "|---|---|" + "---|---|" * len(MEASURES) + "---|---|",
    ]
    for family in r["families"]:
        for run in family["runs"]:
            if "error" in run:
                dashes = " | ".join(["—"] * (2 * len(MEASURES) + 1))  # the columns after it
                lines.append(f"| {_label(family, r)} | {run['dtype']} | {run['error']} "
                             f"| {dashes} |")
                continue
            cells = [run["cells"][m] for m in MEASURES]
            figures = " | ".join(f"{rate(c, 'ours')} / {rate(c, 'transformers')} | {ratio(c)}"
                                 for c in cells)
            shares = " | ".join(f"{share(c, 'ours')} / {share(c, 'transformers')}"
                                for c in (run["cells"]["decode"], run["cells"]["decode batched"]))
            lines.append(f"| {_label(family, r)} | {run['dtype']} | {figures} | {shares} |")
    lines += machine_section(info)
    return "\n".join(lines)


def _label(family: dict, r: dict) -> str:
    """A row's first cell: the model type, and the folder's name for a ``--model`` run."""
    if not r.get("folders"):
        return family["model_type"]
    return f"{family['model_type']} `{Path(family['checkpoint']).name}`"
