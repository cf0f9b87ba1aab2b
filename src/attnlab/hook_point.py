"""``HookPoint``: an identity module that names a place in a model's computation.

``y = x``. A model calls ``self.resid_post(x)`` where the residual stream, a head's scores or
its attention pattern pass by; nothing happens until a forward hook is registered on that
module (``module.register_forward_hook``, or ``attnlab.analysis.hooks``), which then sees the
tensor under the module's qualified name (``"layers.3.self_attn.pattern"``) and may return a
replacement. The hooked computation and the plain one are the same code (TransformerLens's
idea, with PyTorch's own hook machinery).
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.modules import module as torch_module

__all__ = ["HookPoint", "global_hooks", "share_hooks"]


class HookPoint(nn.Module):
    """Identity: ``forward(x) -> x`` for a tensor of any shape (the place names its shape)."""

    def forward(self, x: Tensor) -> Tensor:
        return x

    @property
    def has_hooks(self) -> bool:
        """Whether a forward or pre-forward hook is registered on this point. Global hooks
        (``torch.nn.modules.module.register_module_forward_hook``) do not count: they see
        every point, but ``scores`` and ``pattern`` are formed only for a hook on them."""
        return bool(self._forward_hooks or self._forward_pre_hooks)


# The dicts that hold a module's forward and backward hooks (register_forward_hook,
# register_forward_pre_hook, register_full_backward_hook, ...). State-dict hooks are not
# among them: a swapped-in module's state dict has other entries.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks")


def share_hooks(source: nn.Module, target: nn.Module) -> None:
    """Give ``target``, a module swapped in for ``source``, ``source``'s forward and backward
    hooks: the same dicts, so that a handle returned before the swap still removes its hook
    (a hook registered later on either module is then on both)."""
    for name in _HOOK_DICTS:
        target.__dict__[name] = source.__dict__[name]
    target.__dict__["_is_full_backward_hook"] = source.__dict__["_is_full_backward_hook"]


def global_hooks() -> bool:
    """Whether a hook registered for every module (``torch.nn.modules.module``'s global
    forward hooks) would see a call."""
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)
