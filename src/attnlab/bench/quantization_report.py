"""The markdown table of ``attnlab bench quantization`` and the issue's accuracy targets.

Kept apart from the measuring so that each reads in one sitting; ``result`` is the
``AccuracyResult`` of ``attnlab.bench.quantization.measure_accuracy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlab.bench.harness import machine_section
from attnlab.durable import write_text_atomic

# Positions a forward for the variants scored as a decoder runs: within the rows that the
# quantized GEMVs are offered for (attnlab.quantization.kernels), where a longer forward
# would dequantize the weights and run the formula.
DECODING_ROWS = 16

__all__ = ["DECODING_ROWS", "TARGETS", "Target", "markdown", "targets", "write_report"]

# (weights, int4 group size, the largest perplexity / float32 perplexity allowed): issue 15.
TARGETS = (("int8", None, 1.01), ("int4", 64, 1.05))


@dataclass(frozen=True)
class Target:
    """One target of the issue: ``ratio`` (perplexity / float32's) at most ``limit``;
    ``ratio`` is None when the variant was not measured (a failure)."""

    label: str
    ratio: float | None
    limit: float

    @property
    def passed(self) -> bool:
        return self.ratio is not None and self.ratio <= self.limit

    def describe(self) -> str:
        measured = "not measured" if self.ratio is None else f"{self.ratio:.4f}x"
        return (f"{self.label} perplexity within {(self.limit - 1) * 100:.0f}% of float32 "
                f"(at most {self.limit:.2f}x): {measured}")


def targets(result: Any) -> list[Target]:
    """Each target of ``TARGETS`` with the ratio that ``result`` measured, once per
    activation dtype measured (not measured: one target with no ratio)."""
    base = _float32(result.lm.scores).perplexity
    found = []
    for w, g, limit in TARGETS:
        label = f"{w} g{g}" if g else w
        rows = [r for r in result.lm.scores if (r.variant.weights, r.variant.group_size) == (w, g)]
        found += [Target(label + ("" if r.variant.activations == "float32" else
                                  f" ({r.variant.activations} activations)"),
                         r.perplexity / base, limit) for r in rows] or [Target(label, None, limit)]
    return found


def write_report(result: Any, path: Path) -> Path:
    """Write ``markdown(result)`` to ``path``."""
    write_text_atomic(path, markdown(result))
    return path


def markdown(result: Any) -> str:
    """The run as markdown: how it was made, the LM table, the date table, the targets and
    the machine."""
    s, lm, dates = result.settings, result.lm, result.dates
    base, date_base = _float32(lm.scores), _float32(dates.scores)
    lines = [
        "# Quantized weights: accuracy",
        "",
        f"Measured on {result.machine.get('cpu', 'an unrecorded CPU')} (torch threads: "
        f"{result.machine.get('torch threads', '?')}). Regenerate with "
        f"`attnlab bench quantization`.",
        "",
        f"A character-level `DecoderLM` (Llama style: RoPE, RMSNorm, SwiGLU; {s.layers} "
        f"layers, hidden {s.d_model}, {s.heads} heads, feed-forward {s.d_ff}, tied embedding) "
        f"trained here for {_training(lm.training)}, {s.batch_size} windows "
        f"of {s.block_size} characters a step, on `{s.text}` ({lm.text_chars:,} characters, "
        f"sha256 {lm.text_sha256[:12]}...). Held out: its last {len(lm.held_out):,} "
        f"characters; every one after the first is predicted once, from at most "
        f"{s.block_size} characters before it ({len(lm.held_out) - 1:,} positions, the same "
        f"for every row). Perplexity: exp(mean cross-entropy). Agreement: share of "
        f"positions whose argmax equals float32's. KL: mean KL(float32 || row) of the "
        f"next-character distributions. int8: one scale per output channel; "
        f"int4: a scale and zero point per group of g inputs, chosen by the search, on every "
        f"linear layer, the (tied) embedding in int8 (attnlab's defaults); computing in the "
        f"activations' dtype. The rows with bfloat16 "
        f"activations are scored as a decoder runs, {DECODING_ROWS} positions a forward on a "
        f"KV cache (the date model: {DECODING_ROWS} dates at a time), so that the kernels of "
        f"decoding run (on a CPU with them, the integer products).",
        "",
        "| weights | activations | weight bytes | vs float32 | perplexity | vs float32 "
        "| next-token agreement with float32 | KL vs float32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in lm.scores:
        lines.append(
            f"| {row.variant.label} | {row.variant.activations} | {_bytes(row.weight_bytes)} "
            f"| {row.weight_bytes / base.weight_bytes:.3f}x | {row.perplexity:.4f} "
            f"| {row.perplexity / base.perplexity:.4f}x | {row.agreement:.2%} "
            f"| {row.kl:.5f} |")
    lines += [
        "",
        f"The date translator of `attnlab demo` (2 + 2 layers, hidden 128) trained here for "
        f"{_training(dates.training)}; greedy decoding of "
        f"{dates.examples:,} held-out dates (none of them seen in training).",
        "",
        "| weights | activations | exact match | vs float32 | output equal to float32's |",
        "|---|---|---|---|---|",
    ]
    for row in dates.scores:
        lines.append(
            f"| {row.variant.label} | {row.variant.activations} | {row.exact_match:.2%} "
            f"| {(row.exact_match - date_base.exact_match) * 100:+.2f} points "
            f"| {row.same_as_float32:.2%} |")
    lines += ["", "Targets (issue 15):", ""]
    lines += [f"- {'PASS' if t.passed else 'FAIL'}: {t.describe()}" for t in targets(result)]
    lines += machine_section(result.machine)
    return "\n".join(lines)


def _float32(rows: tuple) -> Any:
    (base,) = [row for row in rows if row.variant.weights == "float32"]
    return base


def _training(t: Any) -> str:
    """``"412 steps (158 s)"``, saying so when the deadline cut the planned run short."""
    cut = "" if t.steps == t.planned else f" of the {t.planned} planned: stopped by the time limit"
    return f"{t.steps} steps{cut} ({t.seconds:.0f} s)"


def _bytes(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"
