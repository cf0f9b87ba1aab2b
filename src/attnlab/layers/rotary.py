"""Rotary position embeddings computed once per forward: cos/sin from positions, then applied.

A decoder calls ``cos, sin = rotary(positions)`` once and every block rotates its queries and
keys with ``apply_rotary(q, cos, sin)``. Feature pairs ``(a, b)`` at position ``p`` turn by the
angle ``p * inv_freq_i``: ``(a, b) -> (a cos - b sin, a sin + b cos)``, written as the
elementwise ``x * cos + rotate(x) * sin`` with cos/sin laid out to match the pairs:

- half-split (Llama, Qwen, transformers' default): pairs ``(x[i], x[i + R/2])``, cos/sin
  ``[c_0 .. c_{R/2-1}, c_0 .. c_{R/2-1}]``;
- interleaved (the paper, GPT-J, ``RoPE(traditional=True)``): pairs ``(x[2i], x[2i+1])``,
  cos/sin ``[c_0, c_0, c_1, c_1, ..]``.

Only the first ``R`` = rotary_dim features of a head turn (partial rotary, Phi, GPT-NeoX);
``inv_freq`` and its scalings come from ``attnlab.layers.rope_scaling``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab._checks import check_positive
from attnlab.formulas import apply_rotary
from attnlab.layers.rope_scaling import (
    RopeScaling,
    check_rope_arguments,
    rope_inverse_frequencies,
)

# RopeScaling, rope_inverse_frequencies and apply_rotary (the rotation's formula, in
# attnlab.formulas so that the attention layers below this package use it too) are part of
# this module's interface.
__all__ = ["RopeScaling", "RotaryEmbedding", "apply_rotary", "rope_inverse_frequencies"]

# The scalings whose frequencies are chosen by the sequence length, read from the positions.
_BY_LENGTH = ("dynamic", "longrope")


class RotaryEmbedding(nn.Module):
    """Positions -> the cos and sin that ``apply_rotary`` multiplies by (float32).

    ``rotary_dim`` R (even) features per head turn; ``base`` is the RoPE theta; positions
    lie in ``[0, max_len)``; ``scaling`` the context extension (default: none);
    ``max_position_embeddings`` is transformers' ``config.max_position_embeddings``, the
    length dynamic NTK starts scaling past and yarn/longrope take their default factor from
    (default ``max_len``; for dynamic give ``max_len`` larger, or nothing is ever scaled).

    Nothing of size ``max_len`` is allocated: each call is one outer product
    ``positions x inv_freq``, so a 128k-context model costs ``L x R`` per forward. The
    ``R/2`` frequencies themselves are computed at the first call, not when the module is
    built: a loader builds the model empty and checks ``R`` against the weights first.

    Only ``dynamic`` and ``longrope`` read the positions back (their largest, one host sync
    per forward), and they refuse positions outside ``[0, max_len)``. The other scalings never
    wait on the device: they apply the formula to whatever positions they are given, and
    keeping them in range is the caller's part (``DecoderLM`` checks its positions first).

    Like transformers, ``dynamic`` and ``longrope`` keep state across calls (decided from
    ``s = max(positions) + 1`` over the whole batch, as a KV cache's decode steps see it):
    dynamic recomputes ``inv_freq`` for ``s`` whenever ``s`` exceeds the largest length seen so
    far (beyond ``max_position_embeddings``), and returns to the unscaled frequencies when a
    call has ``s < max_position_embeddings`` after a longer one; longrope uses the long factors
    while ``s > original_max_position_embeddings``. Keys already in a cache keep the rotation
    they were given, in transformers as here.
    """

    def __init__(self, rotary_dim: int, *, base: float = 10000.0, max_len: int,
                 scaling: RopeScaling | None = None, interleaved: bool = False,
                 max_position_embeddings: int | None = None) -> None:
        super().__init__()
        check_positive("max_len", max_len)
        if not isinstance(interleaved, bool):
            raise TypeError(f"interleaved: expected a bool, got {interleaved!r}")
        if max_position_embeddings is None:
            max_position_embeddings = max_len
        scaling = RopeScaling() if scaling is None else scaling
        check_rope_arguments(rotary_dim, base, scaling, max_position_embeddings)
        self.rotary_dim, self.base, self.max_len = rotary_dim, base, max_len
        self.scaling, self.interleaved = scaling, interleaved
        self.max_position_embeddings = max_position_embeddings
        # Plain attributes, not buffers: `model.to(torch.bfloat16)` would round a buffer, and
        # a model built on the meta device and then loaded would leave one there. They follow
        # the positions' device instead, and are made at the first call (``make_frequencies``).
        self._inv_freq: Tensor | None = None
        self._original_inv_freq: Tensor | None = None
        self._long_inv_freq: Tensor | None = None
        self._attention_factor: float | None = None
        self._max_seq_len_cached = max_position_embeddings  # dynamic: longest length seen

    @property
    def attention_factor(self) -> float:
        """The factor cos and sin are multiplied by (yarn, longrope; 1 otherwise)."""
        self.make_frequencies()
        assert self._attention_factor is not None
        return self._attention_factor

    def make_frequencies(self) -> None:
        """Compute ``inv_freq`` (``R/2`` values, and longrope's long ones) once, at first use;
        ``ValueError`` when the scaling's values overflow together (a loader calls it to refuse
        such a config at load rather than meet NaN at the first token)."""
        if self._inv_freq is not None:
            return
        inv_freq, self._attention_factor = rope_inverse_frequencies(
            self.rotary_dim, self.base, self.scaling, self.max_position_embeddings)
        self._inv_freq = self._original_inv_freq = inv_freq
        if self.scaling.rope_type == "longrope":
            original = (self.scaling.original_max_position_embeddings
                        or self.max_position_embeddings)
            self._long_inv_freq, _ = rope_inverse_frequencies(
                self.rotary_dim, self.base, self.scaling, self.max_position_embeddings,
                seq_len=original + 1)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions ``B x L`` or ``L`` (integers in ``[0, max_len)``) -> cos, sin.

        Both ``B x L x R`` (``1 x L x R`` for ``L`` positions), float32, on the positions'
        device, already multiplied by the attention factor, half-split or interleaved as
        the module was built.
        """
        if not isinstance(positions, Tensor):
            raise TypeError(f"positions: expected an integer Tensor of shape L or B x L, got "
                            f"{type(positions).__name__}")
        if positions.dtype == torch.bool or positions.is_floating_point() \
                or positions.is_complex():
            raise TypeError(f"positions: expected an integer dtype (torch.long), got "
                            f"{positions.dtype}")
        if positions.dim() not in (1, 2):
            raise ValueError(f"positions: expected shape L or B x L, got "
                             f"{tuple(positions.shape)}")
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        if (self.scaling.rope_type in _BY_LENGTH and positions.numel()
                and positions.device.type != "meta"):  # meta: shapes only
            # Their frequencies depend on the longest position: one read back (a host sync).
            low, high = torch.stack(torch.aminmax(positions)).tolist()
            if low < 0 or high >= self.max_len:
                raise ValueError(f"positions: expected values in [0, max_len={self.max_len}), "
                                 f"got min {low} and max {high}")
            self._update_frequencies(high + 1)
        freqs = positions[..., None].float() * self._inv_freq_on(positions.device)  # B x L x R/2
        if self.interleaved:
            angles = freqs.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def _update_frequencies(self, seq_len: int) -> None:
        """transformers' ``dynamic_rope_update``, step for step."""
        self.make_frequencies()
        rope_type = self.scaling.rope_type
        if rope_type == "longrope":
            original = (self.scaling.original_max_position_embeddings
                        or self.max_position_embeddings)
            self._inv_freq = (self._long_inv_freq if seq_len > original
                              else self._original_inv_freq)
        elif rope_type == "dynamic":
            cached = self._max_seq_len_cached
            if seq_len > cached:  # the sequence grew past every earlier one: scale further
                self._inv_freq, _ = rope_inverse_frequencies(
                    self.rotary_dim, self.base, self.scaling, self.max_position_embeddings,
                    seq_len=seq_len)
                self._max_seq_len_cached = seq_len
            if seq_len < self.max_position_embeddings < cached:  # short again: unscaled
                self._inv_freq = self._original_inv_freq
                self._max_seq_len_cached = self.max_position_embeddings

    def _inv_freq_on(self, device: torch.device) -> Tensor:
        """The current ``inv_freq`` on ``device``, kept there: moved once, not in every forward."""
        self.make_frequencies()
        assert self._inv_freq is not None
        if device.type == "meta":  # a shape-only run must not leave the module on meta
            return self._inv_freq.to(device)
        for name in ("_inv_freq", "_original_inv_freq", "_long_inv_freq"):
            held = getattr(self, name)
            if held is not None and held.device != device:
                setattr(self, name, held.to(device))
        return self._inv_freq

    def extra_repr(self) -> str:
        return (f"rotary_dim={self.rotary_dim}, base={self.base}, max_len={self.max_len}, "
                f"rope_type={self.scaling.rope_type!r}, interleaved={self.interleaved}")
