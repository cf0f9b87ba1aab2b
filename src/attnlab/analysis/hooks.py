"""Named hook points inside every attention layer, and ``run_with_cache``.

Every ``MultiHeadAttention`` submodule ``M`` of a model has six hook points, named
``"{M}.{point}"`` (for example ``"decoder.layers.1.cross_attn.pattern"``):

====================  ==========================  ===========================================
point                 shape                       what it is
====================  ==========================  ===========================================
``q``                 ``B x H x L x D``           projected queries (after RoPE, if any)
``k``, ``v``          ``B x G x S x D``           projected new keys / values (before a cache)
``scores``            ``B x H x L x S``           ``Q K^T / sqrt(D)`` with the mask applied
``pattern``           ``B x H x L x S``           ``softmax(scores)``: the attention weights
``z``                 ``B x H x L x D``           per-head outputs ``pattern V``, before W_o
====================  ==========================  ===========================================

A hook is ``fn(tensor, name) -> tensor | None``: returning a tensor replaces the value (an
intervention), returning None leaves it. A layer with a hook runs the ``math`` path for that
call (exact weights whatever its backend); layers without one are untouched. Hooks are
removed when the ``with`` block ends, even when the forward raises.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from attnlab.attention.multihead import MultiHeadAttention

__all__ = [
    "HOOK_POINTS",
    "attention_modules",
    "hook_names",
    "hooks",
    "resolve_names",
    "run_model",
    "run_with_cache",
    "run_with_hooks",
]

HOOK_POINTS = ("q", "k", "v", "scores", "pattern", "z")

HookFn = Callable[[Tensor, str], "Tensor | None"]


def run_with_cache(
    model: nn.Module,
    inputs: Any,
    names: str | Iterable[str],
    *,
    hooks: Mapping[str, HookFn] | None = None,
    detach: bool = True,
) -> tuple[Any, dict[str, Tensor]]:
    """Run ``model`` on ``inputs`` once; return ``(output, {name: tensor})``.

    Only the hook points matched by ``names`` are stored (exact names or ``fnmatch`` patterns
    such as ``"*.pattern"``; see ``hook_names(model)``); a pattern that matches nothing raises
    a ``ValueError``. ``inputs`` is whatever ``run_model`` accepts (or a zero-argument
    callable). ``hooks`` are interventions applied in the same run (stored values are the
    ones after them). Stored tensors are detached unless ``detach=False``.
    """
    wanted = resolve_names(model, names)
    cache: dict[str, Tensor] = {}

    def store(x: Tensor, name: str) -> None:
        cache[name] = x.detach() if detach else x

    chain: dict[str, list[HookFn]] = {}
    for name, fn in (hooks or {}).items():
        for n in resolve_names(model, name):
            chain.setdefault(n, []).append(fn)
    for n in wanted:
        chain.setdefault(n, []).append(store)
    with _installed(model, chain):
        output = run_model(model, inputs)
    return output, cache


def run_with_hooks(model: nn.Module, inputs: Any, fns: Mapping[str, HookFn]) -> Any:
    """Run ``model`` on ``inputs`` with interventions ``{name or pattern: fn}``; its output."""
    with hooks(model, fns):
        return run_model(model, inputs)


@contextmanager
def hooks(model: nn.Module, fns: Mapping[str, HookFn]) -> Iterator[None]:
    """Install ``{name or pattern: fn(tensor, name) -> tensor | None}`` for a ``with`` block."""
    chain: dict[str, list[HookFn]] = {}
    for name, fn in fns.items():
        for n in resolve_names(model, name):
            chain.setdefault(n, []).append(fn)
    with _installed(model, chain):
        yield


def attention_modules(model: nn.Module) -> dict[str, MultiHeadAttention]:
    """``{qualified name: module}`` for every ``MultiHeadAttention`` in ``model``, in order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)}


def hook_names(model: nn.Module) -> list[str]:
    """Every hook point name of ``model``: ``"{module}.{point}"``."""
    return [f"{m}.{p}" for m in attention_modules(model) for p in HOOK_POINTS]


def resolve_names(model: nn.Module, names: str | Iterable[str]) -> list[str]:
    """Exact hook point names or ``fnmatch`` patterns -> the matching names, in model order."""
    patterns = [names] if isinstance(names, str) else list(names)
    every = hook_names(model)
    if not every:
        raise ValueError(
            f"model: expected a model with MultiHeadAttention layers, got {type(model).__name__} "
            "with none"
        )
    chosen: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"names: expected strings, got {type(pattern).__name__}")
        found = fnmatch.filter(every, pattern)
        if not found:
            raise ValueError(
                f"names: {pattern!r} matches no hook point; expected a name or pattern like "
                f"{every[0]!r} or '*.pattern' (points: {', '.join(HOOK_POINTS)})"
            )
        chosen.update(found)
    return [n for n in every if n in chosen]


def run_model(model: nn.Module, inputs: Any) -> Any:
    """Call ``model`` on ``inputs`` the way its kind expects.

    A zero-argument callable is called; a Tensor is ``model(inputs)``; a mapping is
    ``model(**inputs)``; an object with ``.src`` and ``.tgt_in`` (a ``Seq2SeqBatch``) is
    ``model(src, tgt_in)``; a tuple or list is ``model(*inputs)``.
    """
    if callable(inputs) and not isinstance(inputs, (Tensor, nn.Module)):
        return inputs()
    if isinstance(inputs, Tensor):
        return model(inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if hasattr(inputs, "src") and hasattr(inputs, "tgt_in"):
        return model(inputs.src, inputs.tgt_in)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    raise TypeError(
        f"inputs: expected a Tensor, a tuple, a mapping, a Seq2SeqBatch or a callable, got "
        f"{type(inputs).__name__}"
    )


@contextmanager
def _installed(model: nn.Module, chain: Mapping[str, list[HookFn]]) -> Iterator[None]:
    """Set ``hook_fn`` on the modules named in ``chain``; always restore the old values."""
    modules = attention_modules(model)
    per_module: dict[str, dict[str, list[HookFn]]] = {}
    for name, fns in chain.items():
        module, point = name.rsplit(".", 1)
        per_module.setdefault(module, {})[point] = fns
    previous = {m: modules[m].hook_fn for m in per_module}
    try:
        for m, points in per_module.items():
            modules[m].hook_fn = _dispatcher(m, points, previous[m])
        yield
    finally:
        for m, old in previous.items():
            if old is None:
                modules[m].__dict__.pop("hook_fn", None)
            else:
                modules[m].hook_fn = old


def _dispatcher(
    module: str, points: Mapping[str, list[HookFn]], outer: Callable[[str, Tensor], Tensor] | None
) -> Callable[[str, Tensor], Tensor]:
    def hook_fn(point: str, x: Tensor) -> Tensor:
        if outer is not None:  # hooks installed by an enclosing block run first
            x = outer(point, x)
        name = f"{module}.{point}"
        for fn in points.get(point, ()):
            result = fn(x, name)
            if result is not None:
                if not isinstance(result, Tensor) or result.shape != x.shape:
                    got = tuple(result.shape) if isinstance(result, Tensor) else type(result)
                    raise ValueError(
                        f"hook for {name}: expected None or a tensor of shape {tuple(x.shape)}, "
                        f"got {got}"
                    )
                x = result
        return x

    return hook_fn
