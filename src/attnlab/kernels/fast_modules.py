"""Fast inference modules: each is a subclass of the reference module it stands in for, with
its ``__init__`` and ``forward`` arguments, Parameters and ``state_dict``, that runs one of
attnlab's C++ kernels (:mod:`attnlab.kernels.native`) where the call is inference on the CPU,
and the reference's own ``forward`` otherwise (training mode, a tensor that requires grad, a
dtype the kernels do not take, the kernels not built). Each kernel computes the formula of
the reference in one pass, with its roundings; the tests force each module and compare it
with the reference. :mod:`attnlab.kernels.install` swaps them in.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from attnlab.attention.paged import LayerPages, paged_attention
from attnlab.generation.sampling import GreedyTokens
from attnlab.kernels import native
from attnlab.kernels.decode_attention import (
    native_attention,
    native_decoding,
    paged_native_part,
)
from attnlab.layers import FeedForward, GatedMLP, RMSNorm
from attnlab.layers.feedforward import activated
from attnlab.layers.self_attention import SelfAttention

__all__ = ["FastFeedForward", "FastGatedMLP", "FastGreedyTokens", "FastRMSNorm",
           "FastSelfAttention"]


class FastGreedyTokens(GreedyTokens):
    """``GreedyTokens`` (the first index of each row's maximum, NaN first, as
    ``torch.argmax``) in one vectorised C++ pass over float32/bfloat16 CPU logits
    (``native.argmax_rows``): PyTorch reduces a row on one thread without vector loads."""

    def forward(self, logits: Tensor) -> Tensor:
        if logits.dim() == 0 or logits.shape[-1] == 0 or not native.takes(logits.detach()):
            return super().forward(logits)
        flat = logits.reshape(-1, logits.shape[-1]).contiguous()
        return native.argmax_rows(flat).view(logits.shape[:-1])


class FastRMSNorm(RMSNorm):
    """``RMSNorm`` (same arguments and formula) in one C++ pass (``native.rms_norm``) for
    inference on float32/bfloat16 CPU tensors: a decoding step calls it twice per layer on one
    row, where the reference's eight ATen calls cost more than the arithmetic."""

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if self.training or x.shape[-1:] != (self.dim,) or not native.takes(x, weight):
            return super().forward(x)
        flat = x.reshape(-1, self.dim).contiguous()
        return native.rms_norm(flat, weight.contiguous(), self.eps,
                               self.unit_offset).view(x.shape)


class FastGatedMLP(GatedMLP):
    """``GatedMLP`` with ``act(gate) * up`` in one C++ pass (``native.activation``) for
    ``silu`` and ``gelu_tanh`` in inference, where the build has vector loops for it (its
    roundings within float32's; PyTorch's tanh GELU costs several times its exact one)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.training or not _activates(self.activation):
            return super().forward(x)
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(_activated(self.activation, gate, up))


class FastFeedForward(FeedForward):
    """``FeedForward`` with its activation in one C++ pass, as :class:`FastGatedMLP`."""

    def forward(self, x: Tensor) -> Tensor:
        if self.training or not _activates(self.activation):
            return super().forward(x)
        return self.linear2(_activated(self.activation, self.linear1(x)))


class FastSelfAttention(SelfAttention):
    """``SelfAttention`` whose RoPE runs in one C++ pass (``native.rotary``: the same products
    and roundings) and whose attention, for a decoding step's few queries on the ``auto``
    backend with no score hooks, runs ``native.decode_attention`` (and, for a serving step's
    decode rows, ``native.paged_attention``, which reads the keys where they lie in their
    pages instead of gathering them)."""

    def _rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        if self.training or not (_rotary_fits(q, cos, sin) and _rotary_fits(k, cos, sin)):
            return super()._rotate(q, k, cos, sin)
        if cos.dtype != q.dtype:  # as apply_rotary: cos and sin in x's dtype
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        cos, sin = cos.contiguous(), sin.contiguous()
        return (native.rotary(q, cos, sin, self.rope_interleaved),
                native.rotary(k, cos, sin, self.rope_interleaved))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *,
                is_causal: bool, hook: Callable[[str, Tensor], Tensor] | None,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        if (hook is not None or return_weights or self.training or self.backend != "auto"
                or not native_decoding(q, k, v, mask)):
            return super()._attend(q, k, v, mask, is_causal=is_causal, hook=hook,
                                   return_weights=return_weights)
        # One query is the last position: the bottom-right causal mask hides nothing.
        return native_attention(q, k, v, mask, is_causal=is_causal and q.shape[-2] > 1,
                                scale=self.scale)

    def _attend_paged(self, q: Tensor, paged: LayerPages, *,
                      hook: Callable[[str, Tensor], Tensor] | None) -> Tensor:
        if hook is not None or self.training or self.backend != "auto":
            return super()._attend_paged(q, paged, hook=hook)
        return paged_attention(q, paged, scale=self.scale, kernel=paged_native_part)


def _activates(name: str) -> bool:
    return name in native.ACTIVATIONS and native.activation_available()


def _activated(name: str, gate: Tensor, up: Tensor | None = None) -> Tensor:
    """``act(gate) * up`` in one pass where the kernel takes the tensors, else the formula."""
    if (gate.is_contiguous() and (up is None or (up.is_contiguous() and up.shape == gate.shape
                                                 and up.dtype == gate.dtype))
            and native.takes(gate, *(() if up is None else (up,)))):
        return native.activation(gate, up, name)
    return activated(name, gate, up)


def _rotary_fits(x: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Whether ``native.rotary`` takes x ``B x L x H x D`` with cos, sin ``(B or 1) x L x R``
    (what ``apply_rotary`` accepts, x's last dim contiguous, on the CPU without gradients)."""
    if x.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape or x.stride(-1) != 1:
        return False
    B, L, _, D = x.shape
    rows, length, rotary_dim = cos.shape
    if rows not in (1, B) or length != L or rotary_dim % 2 or rotary_dim > D:
        return False
    return x.is_floating_point() and native.takes(x, cos, sin)
