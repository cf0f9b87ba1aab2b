"""Character-level language modelling on any UTF-8 text file the user names.

The first ``1 - valid_fraction`` of the text trains, the rest validates. A training batch is
``size`` windows of ``block_size + 1`` characters at offsets drawn from
``random.Random((seed, step, micro))``: input the first ``block_size``, target the last.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.training.losses import label_smoothed_cross_entropy
from attnlab.training.tasks.vocab import CharVocab

__all__ = ["CharLMTask", "LMBatch", "read_text"]


@dataclass(frozen=True)
class LMBatch:
    """inputs ``B x T`` and targets ``B x T`` (the inputs shifted by one)."""

    inputs: Tensor
    targets: Tensor

    def to(self, device: torch.device | str) -> LMBatch:
        return LMBatch(self.inputs.to(device), self.targets.to(device))


def read_text(path: str | Path) -> str:
    """Read a UTF-8 text file; a missing, empty or non-UTF-8 file raises a clear error."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text: no such file {str(path)!r}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"text: {str(path)!r} is not UTF-8 ({error})") from None
    if not text.strip():
        raise ValueError(f"text: {str(path)!r} is empty; expected some UTF-8 text to learn from")
    return text


class CharLMTask:
    """Next-character prediction over a text; ``vocab`` is built from the text."""

    name = "lm"

    def __init__(
        self,
        text: str,
        *,
        block_size: int = 128,
        seed: int = 0,
        valid_fraction: float = 0.1,
        vocab: CharVocab | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: expected a positive int, got {block_size}")
        self.vocab = vocab or CharVocab.from_texts([text])
        ids = torch.tensor(self.vocab.encode(text), dtype=torch.long)
        if len(ids) < 2 * (block_size + 1):
            raise ValueError(
                f"text: {len(ids)} characters are too few for block_size="
                f"{block_size}; expected at least {2 * (block_size + 1)}"
            )
        cut = min(
            len(ids) - (block_size + 1), max(block_size + 1, int(len(ids) * (1 - valid_fraction)))
        )
        self.train_ids, self.valid_ids = ids[:cut], ids[cut:]
        self.block_size, self.seed = block_size, seed

    def batch(self, step: int, micro: int, size: int, rank: int = 0, world: int = 1) -> LMBatch:
        rng = random.Random(f"{self.seed}/{step}/{micro}")
        high = len(self.train_ids) - self.block_size - 1
        starts = [rng.randint(0, high) for _ in range(size)][rank::world]
        return self._windows(self.train_ids, starts)

    def count(self, batch: LMBatch) -> int:
        return batch.targets.numel()

    def loss(self, model: nn.Module, batch: LMBatch) -> Tensor:
        logits = model(batch.inputs)
        return label_smoothed_cross_entropy(logits, batch.targets, reduction="sum")

    def evaluate(self, model: nn.Module, max_windows: int = 64) -> dict[str, float]:
        """Mean loss over consecutive validation windows."""
        T = self.block_size
        n = min(max_windows, max(1, (len(self.valid_ids) - 1) // T))
        starts = [i * T for i in range(n) if i * T + T + 1 <= len(self.valid_ids)]
        if not starts:
            return {}
        batch = self._windows(self.valid_ids, starts).to(next(model.parameters()).device)
        return {"valid_loss": (self.loss(model, batch) / self.count(batch)).item()}

    def _windows(self, ids: Tensor, starts: list[int]) -> LMBatch:
        idx = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(self.block_size + 1)
        chunk = ids[idx]
        return LMBatch(chunk[:, :-1], chunk[:, 1:])
