"""Capture attention weights of ``MultiHeadAttention`` modules during a forward pass.

A forward hook on each chosen module recomputes that call with ``return_weights=True``
(the ``math`` backend), so the weights are exact whatever backend the model runs with,
and nothing is stored for modules that were not asked for. Hooks are removed even when
the forward raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn

from attnlab.attention.multihead import MultiHeadAttention

__all__ = ["capture_attention"]


def capture_attention(
    model: nn.Module,
    run: Callable[[], Any],
    names: Iterable[str] | None = None,
) -> tuple[Any, dict[str, Tensor]]:
    """Call ``run()`` and return ``(its result, {module name: weights B x H x L x S})``.

    ``names``: qualified names of ``MultiHeadAttention`` submodules of ``model`` (e.g.
    ``"decoder.layers.1.cross_attn"``); all of them when None. Calls that go through a KV
    cache are not captured (recomputing them would extend the cache twice).
    """
    modules = {n: m for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    wanted = list(modules) if names is None else list(names)
    unknown = [n for n in wanted if n not in modules]
    if unknown:
        raise ValueError(
            f"names: {unknown} are not MultiHeadAttention modules of the model; "
            f"expected some of {sorted(modules)}"
        )
    captured: dict[str, Tensor] = {}
    busy: set[str] = set()

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if name in busy or kwargs.get("cache") is not None:
                return
            busy.add(name)
            try:
                _, weights = module(*args, **{**kwargs, "return_weights": True})
            finally:
                busy.discard(name)
            captured[name] = weights.detach()

        return hook

    handles = [modules[n].register_forward_hook(hook_for(n), with_kwargs=True) for n in wanted]
    try:
        result = run()
    finally:
        for h in handles:
            h.remove()
    return result, captured
