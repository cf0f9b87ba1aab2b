"""Multi-head attention: ``MultiHeadAttention`` (with GQA/MQA) and the tiny-llm style
``SimpleMultiHeadAttention``.

``MultiHead(x) = concat(head_1 .. head_H) W_o`` with
``head_h = attention(x W_q^h, k W_k^g, v W_v^g)``, where query head ``h`` uses key/value
head ``g = h // (H / G)``. ``G = H`` is classic MHA, ``1 < G < H`` grouped-query attention,
``G = 1`` multi-query attention.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab._checks import check_positive
from attnlab.attention.kv_cache import LayerKVCache
from attnlab.attention.layer import AttentionLayer
from attnlab.attention.sdpa import BACKENDS, scaled_dot_product_attention
from attnlab.formulas import linear
from attnlab.masks import combine_masks, key_mask_to_attention_mask, key_mask_to_bool

__all__ = [
    "MultiHeadAttention",
    "SimpleMultiHeadAttention",
    "check_input_dtypes",
    "resolve_head_dim",
]


class MultiHeadAttention(AttentionLayer):
    """Self- and cross-attention with ``H`` query heads and ``G`` key/value heads.

    Tensors are batch-first: query ``B x L x E``, key ``B x S x kdim``, value ``B x S x vdim``
    -> ``B x L x E``. ``head_dim`` ``D`` defaults to ``E / H`` but may be anything
    (``H * D != E`` works). ``num_kv_heads`` ``G`` defaults to ``H``; it must divide ``H``.

    Parameters mirror ``torch.nn.MultiheadAttention``: when ``kdim == vdim == E`` one fused
    ``in_proj_weight`` ``((H + 2G) * D) x E`` holds W_q, W_k, W_v stacked (one GEMM for
    self-attention); otherwise ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``.
    ``in_proj_bias`` ``(H + 2G) * D`` and ``out_proj`` (``E x H*D``) follow ``bias``.

    ``dropout`` drops attention weights in training mode; ``output_dropout`` (default 0, as in
    PyTorch, since Transformer layers drop the residual branch themselves) drops the output.
    Initialisation: Xavier-uniform weights, zero biases.

    After the projections, the heads run ``AttentionLayer.heads``, the path that the
    decoders' ``SelfAttention`` runs too: RoPE (``rotary``, with ``rope_interleaved``'s
    layout), hook points (``attnlab.hook_point.HookPoint`` submodules; a forward hook on one
    sees, and may replace, its tensor): ``q`` ``B x H x L x D``, ``k``, ``v`` ``B x G x S x
    D`` (the new keys: after ``rotary``, before the cache), ``scores``, ``pattern`` ``B x H x
    L x S`` and ``z`` (per-head outputs ``B x H x L x D``, before ``out_proj``), the cache,
    attention. The call is the same with or without hooks, on the module's backend; only
    ``scores`` and ``pattern`` need the ``math`` backend (the only one that forms them), so a
    hook there makes ``auto`` run ``math`` and an explicit ``flash``/``fused`` backend raise.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        output_dropout: float = 0.0,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        backend: str = "auto",
        rope_interleaved: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        head_dim = resolve_head_dim(embed_dim, num_heads, head_dim)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_positive("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads: expected a divisor of num_heads={num_heads}, got {num_kv_heads}"
            )
        for name, p in (("dropout", dropout), ("output_dropout", output_dropout)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name}: expected a float in [0, 1), got {p}")
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        kdim = embed_dim if kdim is None else kdim
        vdim = embed_dim if vdim is None else vdim
        check_positive("kdim", kdim)
        check_positive("vdim", vdim)

        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.num_kv_heads, self.kdim, self.vdim = num_kv_heads, kdim, vdim
        self.dropout, self.output_dropout, self.backend = dropout, output_dropout, backend
        self.scale, self.rope_interleaved = None, rope_interleaved
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self._sizes = (q_size, kv_size, kv_size)
        factory = {"device": device, "dtype": dtype}
        self.same_embed_dim = kdim == embed_dim and vdim == embed_dim
        if self.same_embed_dim:
            self.in_proj_weight = nn.Parameter(
                torch.empty(q_size + 2 * kv_size, embed_dim, **factory)
            )
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.register_parameter("in_proj_weight", None)
            self.q_proj_weight = nn.Parameter(torch.empty(q_size, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(kv_size, kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(kv_size, vdim, **factory))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(q_size + 2 * kv_size, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(q_size, embed_dim, bias=bias, **factory)
        self.add_hook_points()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights (the stacked in-projection as one matrix, as PyTorch does)."""
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
            if w is not None:
                nn.init.xavier_uniform_(w)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        mask: Tensor | None = None,
        *,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        return_weights: bool = False,
        cache: LayerKVCache | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` (``B x L x E``) to ``key``/``value`` (``B x S x kdim/vdim``).

        ``key=None`` means self-attention (key = value = query); ``value=None`` means
        value = key. ``mask`` broadcasts to ``B x H x L x S``: bool (True = may attend) or
        additive float. ``key_mask`` is ``B x S``, bool or 0/1 (True / 1 for a real key that
        may be attended: Hugging Face's ``attention_mask`` meaning; PyTorch's
        ``key_padding_mask`` is its negation, see ``attnlab.masks.from_key_padding_mask``); a
        float key_mask with other values is refused. Inputs must have the module's dtype and
        device (under ``torch.autocast`` the dtypes may differ). ``is_causal`` adds the
        bottom-right causal mask.
        Returns ``B x L x E``, or ``(output, weights B x H x L x S)`` with ``return_weights``.

        Incremental decoding (``attnlab.generation``): ``rotary`` is the ``(cos, sin)`` ``B x
        L x R`` of the ``L`` positions (``attnlab.layers.RotaryEmbedding``; self-attention,
        ``S = L``) that turn the projected queries and keys, as in ``SelfAttention``; ``cache``
        (a ``LayerKVCache``) appends the new keys/values and the attention runs over all
        ``offset + L`` of them, so ``mask``/``key_mask`` then cover ``S = offset + L`` keys.
        """
        self_attention = key is None or (key is query and (value is None or value is query))
        key = query if key is None else key
        value = key if value is None else value
        self._check_input("query", query, self.embed_dim)
        self._check_input("key", key, self.kdim)
        self._check_input("value", value, self.vdim)
        check_input_dtypes(_dtype_reference(self.out_proj), query=query, key=key, value=value)
        B, L, _ = query.shape
        S = key.shape[1]
        if key.shape[0] != B or value.shape[:2] != key.shape[:2]:
            raise ValueError(
                f"key, value: expected shapes ({B}, S, ...) with the same S, got key "
                f"{tuple(key.shape)} and value {tuple(value.shape)}"
            )
        if key_mask is not None:
            key_mask = key_mask_to_bool(key_mask)
            S_all = S + (cache.length if cache is not None else 0)  # cached keys come first
            if tuple(key_mask.shape) != (B, S_all):
                raise ValueError(
                    f"key_mask: expected shape B x S = ({B}, {S_all}), got {tuple(key_mask.shape)}"
                )
            mask = combine_masks(mask, key_mask_to_attention_mask(key_mask))

        q, k, v = self._project(query, key, value, self_attention)
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        out, weights = self.heads(
            q.view(B, L, H, D), k.view(B, S, G, D), v.view(B, S, G, D), rotary=rotary,
            mask=mask, is_causal=is_causal, cache=cache, return_weights=return_weights)
        out = self.out_proj(out)
        if self.output_dropout > 0.0 and self.training:
            out = nn.functional.dropout(out, self.output_dropout, training=True)
        return (out, weights) if return_weights else out

    def _project(
        self, query: Tensor, key: Tensor, value: Tensor, self_attention: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``query, key, value`` -> ``B x L x H*D``, ``B x S x G*D``, ``B x S x G*D``."""
        biases = (
            (None, None, None)
            if self.in_proj_bias is None
            else self.in_proj_bias.split(self._sizes)
        )
        if not self.same_embed_dim:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
            return tuple(linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))  # type: ignore[return-value]
        if self_attention:
            return linear(query, self.in_proj_weight, self.in_proj_bias).split(self._sizes, dim=-1)
        w_q, w_k, w_v = self.in_proj_weight.split(self._sizes)
        q = linear(query, w_q, biases[0])
        if key is value:
            # K and V from the same memory: one GEMM over their stacked weights.
            kv_bias = None if self.in_proj_bias is None else self.in_proj_bias[self._sizes[0] :]
            k, v = linear(key, self.in_proj_weight[self._sizes[0] :], kv_bias).split(
                self._sizes[1:], dim=-1
            )
            return q, k, v
        return q, linear(key, w_k, biases[1]), linear(value, w_v, biases[2])

    def _check_input(self, name: str, x: Tensor, dim: int) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != dim:
            raise ValueError(
                f"{name}: expected shape B x len x {dim} (batch first), got {tuple(x.shape)}"
            )

    @classmethod
    def from_torch(
        cls, module: nn.MultiheadAttention, *, backend: str = "auto"
    ) -> MultiHeadAttention:
        """Copy the weights of a ``torch.nn.MultiheadAttention`` so that outputs match it.

        Our module is always batch-first: with a source built with ``batch_first=False``, pass
        ``B x L x E`` tensors (transpose its ``L x B x E`` ones). Its masks map as
        ``mask = ~attn_mask`` (bool; a float ``attn_mask`` is additive and passes as is; a
        ``B*H x L x S`` one reshapes to ``B x H x L x S``) and ``key_mask = ~key_padding_mask``.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(
                f"module: expected torch.nn.MultiheadAttention, got {type(module).__name__}"
            )
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("module: add_bias_kv and add_zero_attn are not supported")
        ref = module.in_proj_weight if module.in_proj_weight is not None else module.q_proj_weight
        new = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            kdim=module.kdim,
            vdim=module.vdim,
            backend=backend,
            device=ref.device,
            dtype=ref.dtype,
        )
        with torch.no_grad():
            for name, param in module.named_parameters():
                new.get_parameter(name).copy_(param)
        return new

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dropout={self.dropout}, backend={self.backend!r}"
        )


class SimpleMultiHeadAttention:
    """Multi-head attention with the weights passed in, in the style of tiny-llm.

    ``wq, wk, wv``: ``(H*D) x E``; ``wo``: ``E x (H*D)`` with ``D = hidden_size / num_heads``.
    Called as ``mha(query, key, value, mask=None)`` with query ``N.. x L x E`` and key/value
    ``M.. x S x E`` -> ``K.. x L x E``, ``K..`` the broadcast of ``N..`` and ``M..``; ``mask``
    broadcasts to ``K.. x H x L x S``.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor
    ) -> None:
        check_positive("hidden_size", hidden_size)
        check_positive("num_heads", num_heads)
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size: expected a multiple of num_heads={num_heads}, got {hidden_size}"
            )
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_dim = hidden_size // num_heads
        inner = num_heads * self.head_dim
        for name, w, shape in (
            ("wq", wq, (inner, hidden_size)),
            ("wk", wk, (inner, hidden_size)),
            ("wv", wv, (inner, hidden_size)),
            ("wo", wo, (hidden_size, inner)),
        ):
            if tuple(w.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(w.shape)}")
        self.wq, self.wk, self.wv, self.wo = wq, wk, wv, wo

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        H, D = self.num_heads, self.head_dim
        q, k, v = (linear(x, w).view(*x.shape[:-1], H, D).transpose(-3, -2)
                   for x, w in ((query, self.wq), (key, self.wk), (value, self.wv)))
        out = scaled_dot_product_attention(q, k, v, mask)  # N.. broadcast as torch.matmul
        return linear(out.transpose(-3, -2).flatten(-2), self.wo)


def _dtype_reference(module: nn.Module) -> Tensor:
    """A tensor of the dtype and device ``module`` computes in: its ``weight``, or for a
    quantized linear layer (integer codes, no float weight; its scales may be float16) an
    empty one of its ``dtype`` beside its ``scales``."""
    weight = module._parameters.get("weight")
    return weight if weight is not None else module.scales.new_empty(0, dtype=module.dtype)


def check_input_dtypes(weight: Tensor, **inputs: Tensor) -> None:
    """Each input must have ``weight``'s dtype and device (a module's parameters): else a
    ``TypeError`` / ``ValueError`` naming the input and both, not a bare error from a matmul.
    Under ``torch.autocast`` for the inputs' device the dtypes may differ (autocast casts)."""
    for name, x in inputs.items():
        if x.device != weight.device:
            raise ValueError(
                f"{name}: expected the module's device {weight.device}, got {x.device}"
            )
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"{name}: expected the module's dtype {weight.dtype}, got {x.dtype}; cast the "
                f"input (.to({weight.dtype})) or the module (.to({x.dtype}))"
            )


def resolve_head_dim(embed_dim: int, num_heads: int, head_dim: int | None) -> int:
    """The head dim ``D``: ``head_dim`` when given, else ``embed_dim / num_heads`` (which must
    divide); every argument checked to be a positive int."""
    check_positive("embed_dim", embed_dim)
    check_positive("num_heads", num_heads)
    if head_dim is None:
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim: expected a multiple of num_heads={num_heads} when head_dim is "
                f"not given, got {embed_dim}"
            )
        head_dim = embed_dim // num_heads
    check_positive("head_dim", head_dim)
    return head_dim
