"""``attnlab bench quantization --model FOLDER --text FILE``: quantized copies of a real
model against its float weights, as llama.cpp's ``perplexity`` tool measures a quantized file.

The float model in FOLDER (float32 unless ``--dtype``) is the reference. Each row is a copy
of it quantized in memory: int8; int4 by round-to-nearest with every weight, token table
included, in 4 bits and scales in the weights' dtype (attnlab's int4 before the search;
groups of the first of ``--group-sizes``, 64 in the committed table, the old default); and
for each of ``--group-sizes``, int4 as the defaults store it (coded scales and zeros; the
token table, embedding and tied head, and the default int8 layers in int8) by
round-to-nearest, by the search
(``attnlab.quantization.search``, the default) and, with ``--calibration FILE``, by GPTQ
(``attnlab.quantization.gptq``, layer by layer on the calibration text). Each copy is scored
on the token ids of ``--text`` by ``attnlab.quantization.quality.measure_quality`` (chunks of
``--context`` tokens, the second half scored): perplexity, its change against the reference,
KL(reference || copy) per token (mean and 99th percentile) and top-1 agreement. Bytes are
the copy's weights (``weight_bytes``: codes, scales, zeros, norms; a tied table once).
Decode tokens/s: the copy with the inference kernels installed, greedy, ``DECODE_TOKENS`` new
tokens after the text's first ``PROMPT_TOKENS`` tokens, batch 1, the median of 3 runs. Writes
``quantization-model.md`` (new run on top, earlier ones kept as history).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.bench.harness import machine_info, machine_section, time_medians
from attnlab.durable import write_text_atomic
from attnlab.kernels import optimize_for_inference
from attnlab.models.io import from_pretrained
from attnlab.quantization import quantize_model, weight_bytes
from attnlab.quantization.gptq import gptq_quantize
from attnlab.quantization.quality import QualityResult, measure_quality
from attnlab.tokenizer import Tokenizer

__all__ = ["DECODE_TOKENS", "PROMPT_TOKENS", "ModelRow", "model_rows", "run_on_model"]

DECODE_TOKENS, PROMPT_TOKENS = 16, 32


@dataclass(frozen=True)
class ModelRow:
    """One quantized copy: its label (method, bits, group), weight bytes, quality against
    the reference and decode tokens/s."""

    method: str
    bits: str
    group: str
    weight_bytes: int
    quality: QualityResult
    decode_tokens_s: float


def run_on_model(args: argparse.Namespace) -> Path:
    """The ``--model`` run of ``attnlab bench quantization``: measure, write, print."""
    if args.text is None:
        raise ValueError("--text: --model needs the text to score (an English UTF-8 file "
                         "of at least two --context chunks)")
    ids = _ids(args.model, args.text)
    calibration = None if args.calibration is None else _ids(args.model, args.calibration)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = model_rows(args.model, ids, context=args.context, group_sizes=args.group_sizes,
                      calibration=calibration, dtype=args.dtype, quick=args.quick)
    text = markdown(args, ids, calibration, rows)
    path = args.out / "quantization-model.md"
    write_text_atomic(path, text)
    print(text.split("\n## Machine\n")[0])
    return path


def model_rows(folder: str | Path, ids: Tensor, *, context: int,
               group_sizes: tuple[int, ...], calibration: Tensor | None = None,
               dtype: str | None = None, quick: bool = False) -> list[ModelRow]:
    """The rows of the module docstring, in its order (the reference first)."""
    reference = from_pretrained(folder, dtype=dtype, kernels=False)
    cached = _Cached(reference)
    copies: list[tuple[str, str, str, Callable[[nn.Module], nn.Module]]] = [
        ("float", str(reference.dtype).removeprefix("torch."), "-", lambda m: m),
        ("nearest", "int8", "row", lambda m: quantize_model(m, "int8")),
        ("nearest", "int4, table int4", str(group_sizes[0]),
         lambda m: quantize_model(m, "int4", group_sizes[0], table_bits=4, fit="nearest",
                                  scale_dtype="weight", int8_layers=())),
    ]
    for g in group_sizes:
        copies += [
            ("nearest", "int4, table int8", str(g),
             lambda m, g=g: quantize_model(m, "int4", g, fit="nearest")),
            ("search", "int4, table int8", str(g),
             lambda m, g=g: quantize_model(m, "int4", g, fit="search")),
        ]
    if calibration is not None:
        copies += [("gptq", "int4, table int8", str(g),
                    lambda m, g=g: gptq_quantize(m, calibration, group_size=g, context=context,
                                                 progress=True))
                   for g in group_sizes]
    rows = []
    for method, bits, group, make in copies:
        print(f"{method}, {bits}, group {group} ...", flush=True)
        model = make(copy.deepcopy(reference)).eval()
        # The reference's own row computes (and keeps) the logits every other row is
        # compared with.
        quality = (measure_quality(cached, ids, context=context) if method == "float" else
                   measure_quality(model, ids, context=context, reference=cached))
        rows.append(ModelRow(method, bits, group, weight_bytes(model), quality,
                             _decode_speed(model, ids, quick)))
        del model
    return rows


def markdown(args: argparse.Namespace, ids: Tensor, calibration: Tensor | None,
             rows: list[ModelRow]) -> str:
    """The report: what was measured, the table, the machine."""
    q = rows[0].quality
    digest = hashlib.sha256(Path(args.text).read_bytes()).hexdigest()[:12]
    calibrated = ("" if calibration is None else
                  f" GPTQ calibrated on `{args.calibration}` ({calibration.numel():,} tokens).")
    lines = [
        "# Quantized copies of a real model",
        "",
        f"Measured on {machine_info()['cpu']} (torch threads: {torch.get_num_threads()}). "
        f"Regenerate with `attnlab bench quantization --model {args.model} --text "
        f"{args.text}" + ("" if calibration is None else f" --calibration {args.calibration}")
        + "`.",
        "",
        f"`{args.model}` scored on `{args.text}` (sha256 {digest}...: {ids.numel():,} tokens, "
        f"{q.chunks} chunks of {q.context}, {q.positions} scored positions), as llama.cpp's "
        f"perplexity tool scores (the second half of each chunk).{calibrated} KL: "
        "KL(reference || copy) per scored token; top-1: share of positions where the copy's "
        "most likely token is the reference's. Decode: greedy, batch 1, "
        f"{DECODE_TOKENS} new tokens, the inference kernels installed.",
        "",
        "| method | bits | group | weight bytes | perplexity | change | KL mean | KL p99 | "
        "top-1 | decode tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = r.quality
        against = (["-", "-", "-", "-"] if k.kl_mean is None else
                   [f"{k.perplexity_change:+.3f}", f"{k.kl_mean:.4f}", f"{k.kl_p99:.4f}",
                    f"{100 * k.top1:.1f}%"])
        lines.append(f"| {r.method} | {r.bits} | {r.group} | {r.weight_bytes / 2**20:.1f} MiB "
                     f"| {k.perplexity:.3f} | " + " | ".join(against)
                     + f" | {r.decode_tokens_s:.1f} |")
    return "\n".join(lines + machine_section(machine_info())) + "\n"


class _Cached:
    """The reference's logits per chunk, computed once for every copy scored against it."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.logits = model, {}

    def __call__(self, input_ids: Tensor) -> Tensor:
        key = tuple(input_ids.flatten().tolist())
        if key not in self.logits:
            out = self.model(input_ids)
            self.logits[key] = out if isinstance(out, Tensor) else out.logits
        return self.logits[key]


def _decode_speed(model: nn.Module, ids: Tensor, quick: bool) -> float:
    """New tokens a second after the first: ``(n - 1) / (t(n) - t(1))``, ``t(k)`` the median
    time of generating ``k`` tokens (the prefill and the first token taken off)."""
    optimize_for_inference(model)
    new = 4 if quick else DECODE_TOKENS
    prompt = ids[:PROMPT_TOKENS].view(1, -1)
    with torch.no_grad():
        t = time_medians({k: (lambda k=k: model.generate(prompt, max_new_tokens=k))
                          for k in (1, new)}, repeats=3, warmup=1)
    return (new - 1) / max(t[new] - t[1], 1e-9)


def _ids(folder: str | Path, path: Path) -> Tensor:
    text = Path(path).read_text(encoding="utf-8")
    return torch.tensor(Tokenizer.from_pretrained(folder).encode(text, add_special_tokens=False))
