"""Parameter counts: ``count_parameters`` and a per-module ``summary``."""

from __future__ import annotations

from torch import nn

__all__ = ["count_parameters", "summary"]


def count_parameters(module: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of scalar parameters of ``module``; a tied (shared) tensor counts once."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def summary(module: nn.Module, *, max_depth: int = 2) -> str:
    """A table of the modules down to ``max_depth`` with their parameter counts.

    Each row counts the parameters under that module (a tied tensor is counted in every
    module that holds it; the total line counts it once).
    """
    rows = [("(total)", type(module).__name__, count_parameters(module))]
    for name, sub in module.named_modules():
        depth = name.count(".") + 1
        if name and depth <= max_depth:
            rows.append(("  " * (depth - 1) + name.rsplit(".", 1)[-1], type(sub).__name__,
                         count_parameters(sub)))
    width = max(len(r[0]) for r in rows)
    type_width = max(len(r[1]) for r in rows)
    lines = [f"{'module':<{width}}  {'type':<{type_width}}  {'params':>12}"]
    lines += [f"{n:<{width}}  {t:<{type_width}}  {c:>12,}" for n, t, c in rows]
    trainable = count_parameters(module, trainable_only=True)
    lines.append(f"trainable: {trainable:,} of {rows[0][2]:,}")
    return "\n".join(lines)
