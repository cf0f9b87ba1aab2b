"""A Qwen2-compatible causal LM (Llama checkpoints load too), built from attnlab's parts.

    x = embed_tokens(input_ids)                                            B x L x E
    for each layer:
        x = x + o_proj(GQA-attention(RoPE(q), RoPE(k), v))   q, k, v = RMSNorm(x) W + b
        x = x + SwiGLU(RMSNorm(x)) = x + W_down(silu(W_gate h) * W_up h)
    logits = lm_head(RMSNorm(x))       lm_head tied to embed_tokens or not    B x L x V

``Qwen2ForCausalLM.from_pretrained(folder)`` loads a Hugging Face checkpoint folder
(``config.json`` + ``model.safetensors`` or a sharded index, memory-mapped) with the weights
as stored: raw-weight parity, no transformation except that q/k/v are stacked into
``MultiHeadAttention``'s ``in_proj_weight`` (one GEMM) and ``o_proj`` is its ``out_proj``.
Qwen2 has q/k/v biases and no o_proj bias; Llama's ``attention_bias`` covers all four.

Positions, as in ``DecoderLM``: with an ``attention_mask`` (``B x (offset + L)``, 1 = real
token) each real token's position is the number of real tokens before it, so left-padded
prompts start at 0 (what Hugging Face's ``generate`` does; its plain forward uses
``0 .. L-1`` unless given ``position_ids``). ``generate(model, ...)`` from
``attnlab.generation`` runs it with a KV cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from attnlab._checks import check_positive, is_int
from attnlab.attention.kv_cache import KVCache, LayerKVCache
from attnlab.attention.multihead import MultiHeadAttention
from attnlab.functional import linear
from attnlab.layers import RMSNorm, RoPE, SwiGLU
from attnlab.masks import causal_mask
from attnlab.models.config import ConfigMixin, check_value
from attnlab.models.hf_loading import (
    CONFIG_NAME,
    check_folder,
    load_tensors,
    parse_dtype,
    read_json,
    save_tensors,
)
from attnlab.models.inputs import decoder_inputs

__all__ = ["Qwen2Config", "Qwen2DecoderLayer", "Qwen2ForCausalLM"]

_LAYOUTS = ("auto", "stored", "columns")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")


@dataclass(frozen=True)
class Qwen2Config(ConfigMixin):
    """Sizes of a Qwen2/Llama model, with Hugging Face's ``config.json`` names.

    ``num_key_value_heads`` (``G``) defaults to ``num_attention_heads`` (``H``) and
    ``head_dim`` (``D``) to ``hidden_size / H``. ``attention_bias``: q/k/v biases (Qwen2:
    always); ``o_proj_bias``: an o_proj bias (Llama with ``attention_bias``).
    ``torch_dtype`` is the stored dtype's name; ``max_len`` is ``max_position_embeddings``.
    ``eos_token_id`` may be given as one id or a list (Hugging Face allows both) and is kept
    as a tuple of ints; it and ``bos_token_id`` must lie in ``[0, vocab_size)``. Every field's
    type is checked (``ConfigMixin``): ``"false"`` is not a bool, ``"2"`` not an id.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = True
    o_proj_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str = "float32"
    model_type: Literal["qwen2", "llama"] = "qwen2"
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        eos = self.eos_token_id  # Hugging Face allows one id or a list of them
        if eos is None or (is_int(eos)):
            object.__setattr__(self, "eos_token_id", () if eos is None else (eos,))
        elif not isinstance(eos, (list, tuple)):
            raise TypeError(f"eos_token_id: expected an int, a list of ints or null, got "
                            f"{eos!r} ({type(eos).__name__})")
        self._check_types()
        for name in (*_REQUIRED, "max_position_embeddings"):
            check_positive(name, getattr(self, name))
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        check_positive("num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: expected a divisor of num_attention_heads="
                             f"{self.num_attention_heads}, got {self.num_key_value_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size: expected a multiple of num_attention_heads="
                                 f"{self.num_attention_heads}, got {self.hidden_size}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        check_positive("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head dim, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number, got {getattr(self, name)}")
        if self.initializer_range < 0:
            raise ValueError(f"initializer_range: expected a number >= 0, got "
                             f"{self.initializer_range}")
        parse_dtype(self.torch_dtype, "torch_dtype")
        ids = {"bos_token_id": () if self.bos_token_id is None else (self.bos_token_id,),
               "eos_token_id": self.eos_token_id}
        for name, values in ids.items():
            if any(not 0 <= i < self.vocab_size for i in values):
                raise ValueError(f"{name}: expected ids in [0, vocab_size={self.vocab_size}), "
                                 f"got {getattr(self, name)!r}")

    @property
    def max_len(self) -> int:
        """The number of positions (``max_position_embeddings``), as ``generate`` reads it."""
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, path: str | Path) -> Qwen2Config:
        """Read a Hugging Face ``config.json`` (a folder holding one, or the file itself).

        Accepts ``model_type`` ``"qwen2"`` and ``"llama"``, the rope base as ``rope_theta``
        (transformers 4) or ``rope_parameters.rope_theta`` (5), and ``torch_dtype`` or
        ``dtype``. Scaled RoPE, sliding-window attention or another activation than SiLU
        raise a ``ValueError`` naming the file and the key, as does any value of the wrong type
        or range. Keys this model does not use are ignored, as transformers does.
        """
        path = Path(path)
        file = path if path.is_file() else check_folder(path) / CONFIG_NAME
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no such file; expected a Hugging Face "
                                    f"{CONFIG_NAME} in the checkpoint folder")
        try:
            return cls(**_fields_from_hf(read_json(file)))
        except (TypeError, ValueError) as error:
            raise type(error)(f"{file}: {error}") from None

    def to_hf(self) -> dict:
        """The Hugging Face ``config.json`` fields (readable by ``from_hf`` and transformers)."""
        arch = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[self.model_type]
        d = {k: getattr(self, k) for k in (*_REQUIRED, "num_key_value_heads", "head_dim",
                                           "rms_norm_eps", "rope_theta",
                                           "max_position_embeddings", "tie_word_embeddings",
                                           "initializer_range", "model_type", "bos_token_id")}
        d.update(architectures=[arch], hidden_act="silu", torch_dtype=self.torch_dtype,
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                 eos_token_id=list(self.eos_token_id) or None)
        if self.model_type == "llama":
            d.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
        return d


class Qwen2ForCausalLM(nn.Module):
    """``forward(input_ids B x L, attention_mask=None, *, cache, logits_to_keep)`` -> logits.

    Submodules carry Hugging Face's names without the ``model.`` prefix: ``embed_tokens``,
    ``layers[i]`` (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``),
    ``norm``, ``lm_head``. A new model is randomly initialised as Hugging Face does
    (``N(0, initializer_range^2)`` weights, zero biases, unit norms).
    """

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        if not isinstance(config, Qwen2Config):
            raise TypeError(f"config: expected a Qwen2Config, got {type(config).__name__}")
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rotary = RoPE(c.head_dim, c.max_position_embeddings, c.rope_theta)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=std)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None, *,
                        layout: str = "auto") -> Qwen2ForCausalLM:
        """Load a Hugging Face checkpoint folder; ``dtype=None`` keeps the config's dtype.

        ``layout`` of the ``out x in`` weight matrices in memory (their values and shapes are
        the stored ones either way): ``"stored"`` uses the memory-mapped tensors in place
        (row-major, no copy when the dtype is kept); ``"columns"`` copies each into
        column-major order (``W.t().contiguous().t()``), for which ``attnlab.functional.linear``
        computes a one-token product at close to memory bandwidth on CPU (about 2x the BLAS
        GEMV on this project's machine), so decoding is faster; ``"auto"`` is ``"columns"``
        on CPU. The model is returned in eval mode with ``requires_grad=False`` weights.
        """
        dtype = parse_dtype(dtype)
        if layout not in _LAYOUTS:
            raise ValueError(f"layout: expected one of {_LAYOUTS}, got {layout!r}")
        config = Qwen2Config.from_hf(path)
        dtype = dtype or parse_dtype(config.torch_dtype)
        hf = load_tensors(path, _hf_shapes(config), dtype=dtype,
                          ignore=("lm_head.weight",) if config.tie_word_embeddings else ())
        state = _from_hf(hf, config)
        if layout in ("columns", "auto"):  # loading is always onto the CPU
            columns = {id(t): t.t().contiguous().t() for k, t in state.items()
                       if t.dim() == 2 and k != "embed_tokens.weight"}  # tied: lm_head's
            state = {k: columns.get(id(t), t) for k, t in state.items()}
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)
        try:
            model.rotary = RoPE(config.head_dim, config.max_position_embeddings,
                                config.rope_theta)
        except RuntimeError as error:  # the tables are max_position_embeddings x D/2
            raise ValueError(f"{Path(path) / CONFIG_NAME}: max_position_embeddings="
                             f"{config.max_position_embeddings} is too large for this machine "
                             f"({error})") from None
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.requires_grad_(False).eval()

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` with Hugging Face's names."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        dtype = str(self.embed_tokens.weight.dtype).removeprefix("torch.")
        hf = {**self.config.to_hf(), "torch_dtype": dtype}
        (path / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n")
        save_tensors(path, _to_hf(self.state_dict(), self.config))
        return path

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                cache: KVCache | None = None, position_ids: Tensor | None = None,
                logits_to_keep: int = 0) -> Tensor:
        """input_ids ``B x L`` -> logits ``B x L x V`` (``B x min(k, L) x V`` for ``k > 0``).

        ``attention_mask`` ``B x (offset + L)``, 1/True = real token, covers the cached
        positions too; ``cache`` (``make_cache``) holds ``offset`` positions and is extended
        by the ``L`` new ones. ``logits_to_keep=k > 0`` projects only the last ``k``
        positions onto the vocabulary (prefill for generation needs ``k = 1``).
        """
        c = self.config
        _, L, offset, key_mask, positions = decoder_inputs(
            input_ids, attention_mask, cache, position_ids, logits_to_keep,
            vocab_size=c.vocab_size, max_len=c.max_position_embeddings,
            max_len_name="max_position_embeddings", num_layers=c.num_hidden_layers)
        if key_mask is not None and bool(key_mask.all()):  # no padding: the plain causal path
            key_mask = None
            positions = offset if position_ids is None else positions  # the same, as an int
        mask = None
        if key_mask is not None:  # B x 1 x L x S: real keys, bottom-right causal
            mask = key_mask[:, None, None, :] & causal_mask(L, offset + L, device=key_mask.device)
        rotary = partial(self.rotary, offset=positions)
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, mask=mask, is_causal=mask is None and L > 1,
                      cache=None if cache is None else cache[i], rotary=rotary)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return linear(self.norm(x), self.lm_head.weight)

    def make_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty ``KVCache``: ``G`` heads per layer, ``max_len`` positions (default: all)."""
        c, p = self.config, self.embed_tokens.weight
        return KVCache(c.num_hidden_layers, batch_size, c.num_key_value_heads,
                       c.max_position_embeddings if max_len is None else max_len, c.head_dim,
                       dtype=p.dtype, device=p.device)


class Qwen2DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``. ``B x L x E``."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        c = config
        E, H, G, D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.input_layernorm = RMSNorm(E, eps=c.rms_norm_eps)
        self.self_attn = MultiHeadAttention(E, H, head_dim=D, num_kv_heads=G, bias=False)
        if c.attention_bias:
            self.self_attn.in_proj_bias = nn.Parameter(torch.zeros((H + 2 * G) * D))
        if c.o_proj_bias:
            self.self_attn.out_proj.bias = nn.Parameter(torch.zeros(E))
        self.post_attention_layernorm = RMSNorm(E, eps=c.rms_norm_eps)
        self.mlp = SwiGLU(E, c.intermediate_size, bias=c.mlp_bias)

    def forward(self, x: Tensor, *, mask: Tensor | None = None, is_causal: bool = True,
                cache: LayerKVCache | None = None, rotary: partial | None = None) -> Tensor:
        """x ``B x L x E``; ``mask`` ``B x 1 x L x S`` (True = may attend) or ``is_causal``."""
        x = x + self.self_attn(self.input_layernorm(x), mask=mask, is_causal=is_causal,
                               cache=cache, rotary=rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


def _fields_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    """``Qwen2Config`` fields from a ``config.json`` object (types are checked by the config)."""
    model_type = check_value("model_type", d.get("model_type", "qwen2"),
                             Literal["qwen2", "llama"])
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"missing key {missing[0]!r}; expected all of {_REQUIRED}")
    if check_value("hidden_act", d.get("hidden_act", "silu"), str) != "silu":
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported; expected 'silu'")
    if check_value("use_sliding_window", d.get("use_sliding_window"), bool | None):
        raise ValueError("use_sliding_window=true is not supported; expected false")
    parameters, scaling = (check_value(k, d.get(k), dict | None) or {}
                           for k in ("rope_parameters", "rope_scaling"))
    rope = parameters or scaling  # transformers 5's name first
    rope_type = check_value("rope_type", rope.get("rope_type", rope.get("type", "default")), str)
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported; expected 'default' "
                         "(unscaled RoPE)")
    bias = check_value("attention_bias", d.get("attention_bias", False), bool)
    dtype_key = "dtype" if d.get("dtype") is not None else "torch_dtype"
    fields = {k: d[k] for k in _REQUIRED}
    fields.update({k: d[k] for k in ("num_key_value_heads", "head_dim", "rms_norm_eps",
                                     "max_position_embeddings", "tie_word_embeddings",
                                     "mlp_bias", "initializer_range", "bos_token_id",
                                     "eos_token_id") if k in d})
    return {**fields, "model_type": model_type,
            "rope_theta": rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            "attention_bias": True if model_type == "qwen2" else bias,
            "o_proj_bias": False if model_type == "qwen2" else bias,
            "torch_dtype": check_value(dtype_key, d.get(dtype_key) or "float32", str)}


def _hf_shapes(c: Qwen2Config) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape, for every tensor the config implies."""
    E, V, F = c.hidden_size, c.vocab_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, E)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (E,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{p}self_attn.{name}_proj.weight"] = (rows, E)
            if c.attention_bias:
                shapes[f"{p}self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (E, q)
        if c.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (E,)
        shapes[p + "post_attention_layernorm.weight"] = (E,)
        for name, shape in (("gate", (F, E)), ("up", (F, E)), ("down", (E, F))):
            shapes[f"{p}mlp.{name}_proj.weight"] = shape
            if c.mlp_bias:
                shapes[f"{p}mlp.{name}_proj.bias"] = shape[:1]
    shapes["model.norm.weight"] = (E,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, E)
    return shapes


def _from_hf(hf: dict[str, Tensor], c: Qwen2Config) -> dict[str, Tensor]:
    """Hugging Face names -> ours: drop ``model.``, stack q/k/v, ``o_proj`` -> ``out_proj``."""
    state: dict[str, Tensor] = {}
    for name, t in hf.items():
        if name.rsplit(".", 2)[-2] not in ("q_proj", "k_proj", "v_proj"):
            state[name.removeprefix("model.").replace(".o_proj.", ".out_proj.")] = t
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            if p + f"q_proj.{kind}" in hf:
                state[f"layers.{i}.self_attn.in_proj_{kind}"] = torch.cat(
                    [hf[p + f"{x}_proj.{kind}"] for x in "qkv"])
    if c.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state


def _to_hf(state: dict[str, Tensor], c: Qwen2Config) -> dict[str, Tensor]:
    """Our names -> Hugging Face's (the inverse of ``_from_hf``; tied lm_head left out)."""
    sizes = (c.num_attention_heads * c.head_dim, *(2 * [c.num_key_value_heads * c.head_dim]))
    hf: dict[str, Tensor] = {}
    for name, t in state.items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        prefix = "" if name.startswith("lm_head") else "model."
        if ".in_proj_" in name:
            layer, kind = name.split(".self_attn.in_proj_")
            for x, part in zip("qkv", t.split(sizes)):
                hf[f"model.{layer}.self_attn.{x}_proj.{kind}"] = part
        else:
            hf[prefix + name.replace(".out_proj.", ".o_proj.")] = t
    return hf
