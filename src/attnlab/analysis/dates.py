"""What the date model's cross-attention does: the output's year digits look at the input's
year, and the heads differ.

``date_alignment_report(checkpoint)`` loads a date checkpoint (``attnlab demo`` writes
``runs/demo/best``), takes held-out pairs whose year can be found in the input exactly once
(``year_targets``), and measures with ``cross_alignment`` how much cross-attention weight the
four year digits of the ISO output (decoder rows 0-3) put on the input's year characters,
against the uniform baseline; it also compares the heads (Jensen-Shannon similarity). With
``out_dir`` it saves the pictures: head similarity per layer, the year mass per layer and
head, and the cross-attention heads of one example.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from attnlab.analysis.alignment import AlignmentResult, cross_alignment
from attnlab.analysis.capture import capture
from attnlab.analysis.plots import plot_attention_heads, plot_head_similarity, plot_metric_map
from attnlab.training.checkpoint import load_config, load_model
from attnlab.training.tasks.seq2seq import make_seq2seq_task

__all__ = ["DateAlignment", "check_date_checkpoint", "date_alignment_report", "year_targets"]


@dataclass(frozen=True)
class DateAlignment:
    """The alignment measures, the pictures written and a printable ``summary()``."""

    result: AlignmentResult
    pictures: list[Path] = field(default_factory=list)

    def summary(self) -> str:
        r = self.result
        lines = [
            f"Cross-attention of the output's year digits on the input's year characters "
            f"({r.examples} held-out dates, {r.skipped} skipped: year not unique in the input).",
            f"Uniform attention would put {r.baseline:.3f} of the weight there.",
        ]
        sims = r.mean_similarity()
        for i, layer in enumerate(r.layers):
            best = int(r.mass[i].argmax())
            lines.append(
                f"  decoder layer {layer}: mean of heads {float(r.mean_head_mass[i]):.3f}; "
                f"best head {best}: mass {float(r.mass[i, best]):.3f}, argmax on the year "
                f"{float(r.hits[i, best]):.1%}; mean similarity between heads {float(sims[i]):.3f}"
            )
        return "\n".join(lines)


def year_targets(source: str, iso: str) -> dict[int, list[int]] | None:
    """``{output position: input positions}`` for the year digits of ``iso`` (``YYYY-MM-DD``).

    The 4-digit year found exactly once in ``source`` aligns output rows 0-3 with it; else a
    2-digit year (``11/21/26``) found exactly once aligns rows 2-3 with its two characters.
    None when the year is absent or ambiguous.
    """
    year = iso[:4]
    if len(iso) < 4 or not year.isdigit():
        return None
    if source.count(year) == 1:
        p = source.index(year)
        return {t: [p + t] for t in range(4)}
    if year not in source and source.count(year[2:]) == 1:
        p = source.index(year[2:])
        return {2: [p], 3: [p + 1]}
    return None


def date_alignment_report(
    checkpoint: str | Path | tuple[nn.Module, object],
    *,
    n: int = 500,
    out_dir: str | Path | None = None,
) -> DateAlignment:
    """Alignment of year digits and head similarity on ``n`` held-out dates.

    ``checkpoint``: a checkpoint folder of the date task, or ``(model, task)``.
    """
    model, task = _load(checkpoint)
    pairs = list(task.test[:n])  # type: ignore[attr-defined]
    result = cross_alignment(model, task, pairs, year_targets)
    pictures: list[Path] = []
    if out_dir is not None:
        out = Path(out_dir)
        for i, layer in enumerate(result.layers):
            pictures.append(plot_head_similarity(
                result.similarity[i], out / f"head_similarity_layer{layer}.png",
                title=f"cross-attention head similarity, decoder layer {layer}"))
        pictures.append(plot_metric_map(
            result.mass, out / "year_mass.png", row_labels=[f"layer {x}" for x in result.layers],
            title=f"weight of year digits on the input year (uniform: {result.baseline:.2f})"))
        src, iso = next(p for p in pairs if year_targets(*p))
        batch = task.encode([(src, iso)])  # type: ignore[attr-defined]
        maps = capture(model, batch, kinds=["cross"])["cross"]
        w, _, _ = maps.example(0)
        out_tokens = ["<bos>", *iso]
        pictures.append(plot_attention_heads(
            w[-1, :, : len(out_tokens)], out_tokens, list(src), out / "cross_attention_heads.png",
            title=f"{src!r} -> {iso} (last decoder layer)"))
    return DateAlignment(result, pictures)


def check_date_checkpoint(checkpoint: str | Path) -> dict[str, Any]:
    """The config of ``checkpoint`` when it is a date-task Transformer checkpoint (read from
    its ``config.json`` alone, so a wrong folder is refused before any work); else a
    ``ValueError`` that says what the folder holds."""
    try:
        config = load_config(checkpoint)
    except ValueError as error:  # e.g. a Hugging Face folder: say what was expected first
        raise ValueError(f"checkpoint: expected a date-task Transformer checkpoint; "
                         f"{str(error).removeprefix('checkpoint: ')}") from None
    extra = config.get("extra", {})
    if config.get("model_type") != "transformer" or extra.get("task") != "dates":
        raise ValueError(
            f"checkpoint: expected a date-task Transformer checkpoint, got model_type "
            f"{config.get('model_type')!r} with task {extra.get('task')!r} in {str(checkpoint)!r}"
        )
    return config


def _load(checkpoint: str | Path | tuple[nn.Module, object]) -> tuple[nn.Module, object]:
    if isinstance(checkpoint, tuple):
        return checkpoint
    check_date_checkpoint(checkpoint)
    model, config = load_model(checkpoint)
    extra = config.get("extra", {})
    task = make_seq2seq_task("dates", seed=extra.get("seed", 0), n_valid=1)
    if task.src_vocab.chars != extra.get("src_chars", task.src_vocab.chars):
        raise ValueError(f"checkpoint: {str(checkpoint)!r} was trained with another vocabulary")
    return model.eval(), task
