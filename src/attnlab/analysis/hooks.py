"""Named hook points of any model, and ``run_with_cache``.

A hook point is a ``attnlab.hook_point.HookPoint`` submodule (an identity); its name is its
qualified module name. Every attention layer (``SelfAttention`` of ``DecoderLM`` and every
family, ``MultiHeadAttention`` of the ``Transformer``) ``M`` has six, named
``"{M}.{point}"`` (for example ``"decoder.layers.1.cross_attn.pattern"`` or
``"layers.0.self_attn.z"``), and each ``DecoderLM`` block ``layers.{i}`` five on the
residual stream:

====================  ==========================  ===========================================
point                 shape                       what it is
====================  ==========================  ===========================================
``q``                 ``B x H x L x D``           projected queries (after RoPE, if any)
``k``, ``v``          ``B x G x S x D``           projected new keys / values (before a cache)
``scores``            ``B x H x L x S``           ``Q K^T * scale`` with the mask applied
``pattern``           ``B x H x L x S``           ``softmax(scores)``: the attention weights
``z``                 ``B x H x L x D``           per-head outputs ``pattern V``, before W_o
``resid_pre``         ``B x L x E``               the block's input
``attn_out``          ``B x L x E``               the attention's output (after W_o)
``resid_mid``         ``B x L x E``               ``resid_pre + attn_out``
``mlp_out``           ``B x L x E``               the MLP's output
``resid_post``        ``B x L x E``               ``resid_mid + mlp_out``: the next block's input
====================  ==========================  ===========================================

A hook is ``fn(tensor, name) -> tensor | None``: returning a tensor replaces the value (an
intervention; it must keep the shape), returning None leaves it. Hooks are PyTorch forward
hooks on the points, removed when the ``with`` block ends, even when the forward raises; an
enclosing block's hooks run first. The hooked forward is the model's own: hooks on ``q``,
``k``, ``v``, ``z`` or the residual stream leave the attention backend as it is; ``scores``
and ``pattern`` exist only on the ``math`` backend, so a layer whose backend is ``auto`` runs
``math`` while they are hooked, and one built with ``flash`` or ``fused`` is refused.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import Tensor, nn

from attnlab.hook_point import HookPoint

__all__ = [
    "HOOK_POINTS",
    "RESIDUAL_POINTS",
    "attention_modules",
    "hook_names",
    "hook_points",
    "hooks",
    "resolve_names",
    "run_model",
    "run_with_cache",
    "run_with_hooks",
]

HOOK_POINTS = ("q", "k", "v", "scores", "pattern", "z")
RESIDUAL_POINTS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
# The points that only the math backend forms.
_MATH_ONLY = ("scores", "pattern")

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
    ones after them). Stored tensors are detached unless ``detach=False``. A point called
    several times (incremental decoding) keeps the tensor of its last call.
    """
    wanted = resolve_names(model, names)
    cache: dict[str, Tensor] = {}

    def store(x: Tensor, name: str) -> None:
        cache[name] = x.detach() if detach else x

    chain = _chain(model, hooks or {}, "hooks")
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
    with _installed(model, _chain(model, fns, "fns")):
        yield


def hook_points(model: nn.Module) -> dict[str, HookPoint]:
    """``{qualified name: HookPoint}`` for every hook point of ``model``, in model order."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return {n: m for n, m in model.named_modules() if isinstance(m, HookPoint)}


def hook_names(model: nn.Module) -> list[str]:
    """Every hook point name of ``model`` (``"layers.0.self_attn.q"``, ...), in model order."""
    return list(hook_points(model))


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{qualified name: module}`` for every module of ``model`` that has the six attention
    hook points (``q k v scores pattern z``) as ``HookPoint`` children, in order.

    Such a module states its ``num_heads`` (and ``num_kv_heads``), as ``SelfAttention`` and
    ``MultiHeadAttention`` do.
    """
    found = {}
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if all(isinstance(children.get(p), HookPoint) for p in HOOK_POINTS):
            found[name] = module
    return found


def resolve_names(model: nn.Module, names: str | Iterable[str]) -> list[str]:
    """Exact hook point names or ``fnmatch`` patterns -> the matching names, in model order."""
    if isinstance(names, str):
        patterns = [names]
    elif isinstance(names, Iterable):
        patterns = list(names)
    else:
        raise TypeError(f"names: expected a string or strings, got {type(names).__name__}")
    every = hook_names(model)
    if not every:
        raise ValueError(
            f"model: expected a model with hook points (HookPoint modules), got "
            f"{type(model).__name__} with none"
        )
    chosen: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"names: expected strings, got {type(pattern).__name__}")
        found = fnmatch.filter(every, pattern)
        if not found:
            raise ValueError(
                f"names: {pattern!r} matches no hook point; expected a name or pattern like "
                f"{every[0]!r} or '*.pattern' (attention points: {', '.join(HOOK_POINTS)}; "
                f"residual points: {', '.join(RESIDUAL_POINTS)})"
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


def _chain(model: nn.Module, fns: Mapping[str, HookFn], arg: str
           ) -> dict[str, list[HookFn]]:
    """``{name or pattern: fn}`` (the argument ``arg``) -> ``{point name: [fn, ...]}``."""
    if not isinstance(fns, Mapping):
        raise TypeError(f"{arg}: expected a mapping {{name or pattern: fn}}, got "
                        f"{type(fns).__name__}")
    chain: dict[str, list[HookFn]] = {}
    for name, fn in fns.items():
        if not callable(fn):
            raise TypeError(f"{arg}[{name!r}]: expected a callable fn(tensor, name), got "
                            f"{type(fn).__name__}")
        for n in resolve_names(model, name):
            fns_here = chain.setdefault(n, [])
            if fn not in fns_here:  # two patterns naming one point: the fn runs once there
                fns_here.append(fn)
    return chain


@contextmanager
def _installed(model: nn.Module, chain: Mapping[str, list[HookFn]]) -> Iterator[None]:
    """Register one forward hook per point named in ``chain``; always remove them."""
    points = hook_points(model)
    for name in chain:
        _check_backend(model, name)
    with ExitStack() as handles:
        for name, fns in chain.items():
            handles.callback(points[name].register_forward_hook(_forward_hook(name, fns)).remove)
        yield


def _check_backend(model: nn.Module, name: str) -> None:
    """``scores``/``pattern`` of a layer built with a backend that does not form them: refuse
    before running (``auto`` switches to ``math`` by itself)."""
    parent, _, point = name.rpartition(".")
    backend = getattr(model.get_submodule(parent), "backend", "auto") if parent else "auto"
    if point in _MATH_ONLY and backend not in ("auto", "math"):
        raise ValueError(
            f"hook point {name!r}: expected a layer with backend 'auto' or 'math' (only the "
            f"math backend forms scores and pattern), got backend {backend!r}"
        )


def _forward_hook(name: str, fns: list[HookFn]) -> Callable[[nn.Module, Any, Tensor], Tensor]:
    def hook(module: nn.Module, args: Any, x: Tensor) -> Tensor:
        for fn in fns:
            result = fn(x, name)
            if result is not None:
                _check_replacement(name, result, x)
                x = result
        return x

    return hook


def _check_replacement(name: str, new: object, old: Tensor) -> None:
    """A hook's replacement must fit where the old tensor was: same shape, dtype, device."""
    if not isinstance(new, Tensor):
        raise TypeError(f"hook for {name}: expected None or a Tensor, got {type(new).__name__}")
    got, want = (tuple(new.shape), new.dtype, new.device), (tuple(old.shape), old.dtype,
                                                             old.device)
    if got != want:
        raise ValueError(
            f"hook for {name}: expected None or a tensor of shape {want[0]}, dtype {want[1]} "
            f"on {want[2]}, got shape {got[0]}, dtype {got[1]} on {got[2]}"
        )
