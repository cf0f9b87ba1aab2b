"""Head ablation: switch heads off and measure what the model loses.

Ablating head ``h`` of a layer replaces its per-head output ``z[:, h]`` (``B x L x D``, the
``z`` hook point, before W_o) by zeros (``mode="zero"``) or by its mean over a batch and
positions (``mode="mean"``, which keeps the layer's average input to W_o). ``head_importance``
ablates each head in turn and tabulates the change in the metrics an ``evaluate`` function
returns, e.g. ``seq2seq_metrics`` (loss and token accuracy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from attnlab.analysis.capture import checked_list, classify
from attnlab.analysis.hooks import attention_modules, hooks, run_with_cache
from attnlab.analysis.table import Table

__all__ = ["ablate_heads", "head_importance", "head_means", "seq2seq_metrics", "token_metrics"]

MODES = ("zero", "mean")


@contextmanager
def ablate_heads(
    model: nn.Module,
    heads: Mapping[str, Iterable[int]],
    *,
    mode: str = "zero",
    means: Mapping[str, Tensor] | None = None,
) -> Iterator[None]:
    """Within the ``with`` block, ablate ``{attention module name: head indices}``.

    ``mode="zero"`` sets ``z[:, h] = 0``; ``mode="mean"`` sets it to ``means[module][h]``
    (``H x D``, from ``head_means``) or, without ``means``, to the mean of ``z[:, h]`` over
    the batch and positions of the same call.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if not isinstance(heads, Mapping):
        raise TypeError(f"heads: expected a mapping {{attention module name: head indices}}, "
                        f"got {type(heads).__name__}")
    modules = attention_modules(model)
    fns = {}
    for name, hs in heads.items():
        if name not in modules:
            raise ValueError(f"heads: {name!r} is not an attention module; expected one of "
                             f"{list(modules)}")
        H = modules[name].num_heads
        hs = sorted(set(checked_list(f"heads[{name!r}]", hs, int)))
        if any(not 0 <= h < H for h in hs):
            raise ValueError(f"heads: {name!r} has heads 0 .. {H - 1}, got {hs}")
        fns[f"{name}.z"] = _ablation(hs, mode, None if means is None else means.get(name))
    with hooks(model, fns):
        yield


def head_importance(
    model: nn.Module,
    evaluate: Callable[[], Mapping[str, float]],
    *,
    mode: str = "zero",
    modules: Iterable[str] | None = None,
) -> Table:
    """Ablate every head of every (or each named) attention module in turn; one row per head.

    ``evaluate()`` runs the model and returns metrics such as ``{"loss": ..., "accuracy":
    ...}``. Columns: ``kind, layer, head``, then per metric its value with the head ablated
    and ``delta_<metric> = ablated - baseline`` (a large loss increase = an important head).
    ``mode="mean"`` uses the means of ``z`` over one baseline run of ``evaluate``.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    modules_by_name = attention_modules(model)
    names = list(modules_by_name) if modules is None else checked_list("modules", modules, str)
    unknown = [n for n in names if n not in modules_by_name]
    if unknown:
        raise ValueError(f"modules: {unknown} are not attention modules; expected some of "
                         f"{list(modules_by_name)}")
    with torch.no_grad():
        baseline, cache = run_with_cache(model, evaluate, [f"{n}.z" for n in names])
        means = {n: cache[f"{n}.z"].float().mean(dim=(0, 2)) for n in names} if mode == "mean" \
            else None
        keys = list(baseline)
        table = Table(["kind", "layer", "head", *[c for k in keys for c in (k, f"delta_{k}")]])
        for name in names:
            kind, layer = classify(model, name)
            for h in range(modules_by_name[name].num_heads):
                with ablate_heads(model, {name: [h]}, mode=mode, means=means):
                    result = evaluate()
                cells = [c for k in keys
                         for c in (float(result[k]), float(result[k]) - float(baseline[k]))]
                table.rows.append([kind, layer, h, *cells])
    return table


def head_means(model: nn.Module, inputs: object) -> dict[str, Tensor]:
    """``{module: H x D}``: each head's output ``z`` averaged over batch and positions."""
    with torch.no_grad():
        _, cache = run_with_cache(model, inputs, "*.z")
    return {n[: -len(".z")]: z.float().mean(dim=(0, 2)) for n, z in cache.items()}


def token_metrics(
    logits: Tensor, targets: Tensor, ignore_index: int | None = 0
) -> dict[str, float]:
    """``{"loss": mean cross-entropy, "accuracy": share of argmax == target}`` over the tokens
    whose target is not ``ignore_index``. logits ``B x T x V``, targets ``B x T``."""
    keep = torch.ones_like(targets, dtype=torch.bool) if ignore_index is None \
        else targets != ignore_index
    flat = logits[keep].float()
    loss = nn.functional.cross_entropy(flat, targets[keep])
    accuracy = (flat.argmax(-1) == targets[keep]).float().mean()
    return {"loss": float(loss), "accuracy": float(accuracy)}


def seq2seq_metrics(model: nn.Module, batch: object) -> Callable[[], dict[str, float]]:
    """An ``evaluate`` for ``head_importance``: teacher-forced loss and token accuracy of an
    encoder-decoder on a ``Seq2SeqBatch`` (``src``, ``tgt_in``, ``tgt_out``; pad id 0)."""

    def evaluate() -> dict[str, float]:
        return token_metrics(model(batch.src, batch.tgt_in), batch.tgt_out)  # type: ignore[attr-defined]

    return evaluate


def _ablation(
    heads: list[int], mode: str, mean: Tensor | None
) -> Callable[[Tensor, str], Tensor]:
    def fn(z: Tensor, name: str) -> Tensor:  # z: B x H x L x D
        z = z.clone()
        for h in heads:
            if mode == "zero":
                z[:, h] = 0
            elif mean is not None:
                z[:, h] = mean[h].to(z)
            else:
                z[:, h] = z[:, h].mean(dim=(0, 1))
        return z

    return fn
