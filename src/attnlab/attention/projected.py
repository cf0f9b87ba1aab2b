"""The frame shared by the efficient attention layers: project, attend per head, project back.

``out = concat_h(attend(x W_q^h, k W_k^h, v W_v^h)) W_o`` where ``attend`` is what a subclass
brings (block-sparse, Linformer, Performer). The parameters are laid out as those of
:class:`attnlab.attention.MultiHeadAttention` with ``G = H`` and ``kdim = vdim = E``
(``in_proj_weight`` ``3*H*D x E``, ``in_proj_bias``, ``out_proj``), so the layers are drop-in
replacements: a ``MultiHeadAttention`` state dict loads into any of them (``strict=False``
where a layer has parameters of its own, such as Linformer's projections).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.attention.multihead import check_input_dtypes, resolve_head_dim
from attnlab.formulas import linear
from attnlab.masks import key_mask_to_bool

__all__ = ["ProjectedAttention"]


class ProjectedAttention(nn.Module):
    """Base of the drop-in layers: query ``B x L x E``, key/value ``B x S x E`` -> ``B x L x E``.

    ``head_dim`` ``D`` defaults to ``E / H``. Subclasses implement :meth:`attend`.
    Initialisation as ``MultiHeadAttention``: Xavier-uniform weights, zero biases.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        head_dim = resolve_head_dim(embed_dim, num_heads, head_dim)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        inner = num_heads * head_dim
        factory = {"device": device, "dtype": dtype}
        self.in_proj_weight = nn.Parameter(torch.empty(3 * inner, embed_dim, **factory))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * inner, **factory)) if bias else None
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias, **factory)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if bias:
            nn.init.zeros_(self.out_proj.bias)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        """Attend from ``query`` (``B x L x E``) to ``key``/``value`` (``B x S x E``).

        ``key=None`` is self-attention, ``value=None`` means value = key. ``key_mask``
        ``B x S``, bool or 0/1, is True / 1 for a real key (PyTorch's ``key_padding_mask`` is
        its negation); other values are refused.
        ``is_causal`` asks for the bottom-right causal form where the layer has one.
        Returns ``B x L x E``.
        """
        key = query if key is None else key
        value = key if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name}: expected a Tensor, got {type(x).__name__}")
            if x.dim() != 3 or x.shape[-1] != self.embed_dim:
                raise ValueError(
                    f"{name}: expected shape B x len x {self.embed_dim} (batch first), got "
                    f"{tuple(x.shape)}"
                )
        check_input_dtypes(self.in_proj_weight, query=query, key=key, value=value)
        B, L, _ = query.shape
        S = key.shape[1]
        if key.shape[0] != B or value.shape[:2] != key.shape[:2]:
            raise ValueError(
                f"key, value: expected shapes ({B}, S, {self.embed_dim}) with the same S, got "
                f"key {tuple(key.shape)} and value {tuple(value.shape)}"
            )
        if key_mask is not None:
            key_mask = key_mask_to_bool(key_mask)
        if key_mask is not None and tuple(key_mask.shape) != (B, S):
            raise ValueError(
                f"key_mask: expected shape B x S = ({B}, {S}), got {tuple(key_mask.shape)}"
            )
        H, D = self.num_heads, self.head_dim
        if key is query and value is query:
            q, k, v = linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            ws = self.in_proj_weight.chunk(3)
            bs = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
            q, k, v = (linear(x, w, b_) for x, w, b_ in zip((query, key, value), ws, bs))
        q = q.reshape(B, L, H, D).transpose(1, 2)
        k = k.reshape(B, S, H, D).transpose(1, 2)
        v = v.reshape(B, S, H, D).transpose(1, 2)
        out = self.attend(q, k, v, key_mask=key_mask, is_causal=is_causal)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, H * D))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, key_mask: Tensor | None,
               is_causal: bool) -> Tensor:
        """q ``B x H x L x D``, k/v ``B x H x S x D`` -> ``B x H x L x D`` (the subclass's)."""
        raise NotImplementedError
