"""Shared test helpers: an oracle comparison with a per-dtype tolerance table."""

from __future__ import annotations

import torch

# DESIGN.md: float32 rtol 1e-5 / atol 1e-6; half precisions looser.
TOLERANCES = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    what: str = "",
) -> None:
    """``torch.testing.assert_close`` with our per-dtype defaults; on failure it names the
    worst mismatching elements (index, actual, expected)."""
    default_rtol, default_atol = TOLERANCES[expected.dtype]
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as error:
        diff = (
            (actual.detach().double() - expected.detach().double()).abs().nan_to_num(float("inf"))
        )
        worst = diff.flatten().topk(min(5, diff.numel())).indices
        lines = [
            f"  at {tuple(int(i) for i in torch.unravel_index(idx, diff.shape))}: "
            f"actual {actual.flatten()[idx].item():.8g}, "
            f"expected {expected.flatten()[idx].item():.8g}"
            for idx in worst
        ]
        raise AssertionError(f"{what}\n{error}\nworst elements:\n" + "\n".join(lines)) from None
