"""GPT-2 (model_type ``gpt2``): ``config.json`` <-> config, stored names <-> ours.

GPT-2 is the decoder with learned positions (``wpe``), LayerNorm with a shift, a two-layer
GELU MLP (``gelu_new``, the tanh approximation) and biases everywhere, its head tied to the
token embedding. Its weights are ``Conv1D``: stored ``in x out``, transposed to our
``out x in``; ``c_attn`` holds q, k and v in one tensor (split along our dim 0). Checkpoints
saved from ``GPT2LMHeadModel`` prefix the names with ``transformer.``, those saved from
``GPT2Model`` (the original ``gpt2`` upload) do not: both read. The causal-mask buffers of
old checkpoints (``attn.bias``, ``attn.masked_bias``) are skipped.

The dropout probabilities (``attn_pdrop``, ``resid_pdrop``, ``embd_pdrop``) are not read: a
loaded model runs without dropout (set ``DecoderLMConfig.dropout`` to fine-tune with one).

Refused, naming the key: ``scale_attn_by_inverse_layer_idx`` and ``reorder_and_upcast_attn``
true (the Stanford CRFM runs), ``add_cross_attention`` true (an encoder-decoder part), an
``activation_function`` other than ``gelu_new``, ``gelu_pytorch_tanh``, ``gelu``, ``relu``.
``scale_attn_weights`` false (unscaled scores) reads as ``attention_scale=1``.
"""

from __future__ import annotations

from typing import Any

from attnlab._checks import check_positive
from attnlab.models.config import check_value
from attnlab.models.decoder_config import DecoderLMConfig
from attnlab.models.families.base import Family, WeightMap, config_from_keys

__all__ = ["FAMILY", "gpt2_weights", "read_gpt2", "tiny_config", "write_gpt2"]

# config.json key -> DecoderLMConfig field; GPT2Config's defaults for the optional ones.
_REQUIRED = {"vocab_size": "vocab_size", "n_embd": "d_model", "n_layer": "num_layers",
             "n_head": "num_heads", "n_positions": "max_len"}
# key -> (field, GPT2Config's default, type).
_OPTIONAL = {"n_inner": ("d_ff", None, int | None),
             "layer_norm_epsilon": ("norm_eps", 1e-5, float),
             "tie_word_embeddings": ("tie_embeddings", True, bool),
             "initializer_range": ("initializer_range", 0.02, float),
             "bos_token_id": ("bos_token_id", None, int | None),
             "eos_token_id": ("eos_token_id", None, int | list[int] | None)}
# transformers' GPT2Config.attribute_map: a config.json may use the common names instead.
_ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
            "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}
# activation_function -> our MLP kind (gelu_new and gelu_pytorch_tanh are the same formula).
_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                "relu": "relu"}
_REFUSED = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")
PREFIX = "transformer."


def read_gpt2(d: dict[str, Any]) -> DecoderLMConfig:
    """``DecoderLMConfig`` of a GPT-2 ``config.json`` object; errors name the key."""
    for alias, key in _ALIASES.items():
        if alias in d and key in d and d[alias] != d[key]:
            raise ValueError(f"{alias} {d[alias]!r} and {key} {d[key]!r} disagree; GPT-2 reads "
                             f"{alias} as {key}: expected one of them, or equal values")
    d = {**{_ALIASES[k]: v for k, v in d.items() if k in _ALIASES}, **d}
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"missing key {missing[0]!r}; expected all of {tuple(_REQUIRED)}")
    for key in _REFUSED:
        if check_value(key, d.get(key, False), bool):
            raise ValueError(f"{key}=true is not supported for gpt2; expected false")
    act = check_value("activation_function", d.get("activation_function", "gelu_new"), str)
    if act not in _ACTIVATIONS:
        raise ValueError(f"activation_function {act!r} is not supported for gpt2; expected one "
                         f"of {sorted(_ACTIVATIONS)}")
    fields: dict[str, Any] = {ours: check_positive(key, d[key]) for key, ours in _REQUIRED.items()}
    fields.update({ours: check_value(key, default if d.get(key) is None else d[key], hint)
                   for key, (ours, default, hint) in _OPTIONAL.items()})
    # Without scale_attn_weights GPT-2 leaves the scores unscaled: a scale of 1.
    scaled = check_value("scale_attn_weights", d.get("scale_attn_weights", True), bool)
    keys = {**{ours: key for key, ours in _REQUIRED.items()},
            **{ours: key for key, (ours, _, _) in _OPTIONAL.items()}}
    return config_from_keys(keys, **fields, position="learned", norm="layernorm",
                            mlp=_ACTIVATIONS[act], bias=True,
                            attention_scale=None if scaled else 1.0, family="gpt2")


def write_gpt2(c: DecoderLMConfig) -> dict[str, Any]:
    """A GPT-2 ``config.json`` object for ``c`` (read back by ``read_gpt2`` and transformers;
    ``save_family`` refuses a ``c`` that GPT-2 cannot hold, a rotary one say)."""
    d = {key: getattr(c, ours) for key, ours in _REQUIRED.items()}
    d.update({key: getattr(c, ours) for key, (ours, _, _) in _OPTIONAL.items()})
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}.get(c.mlp, c.mlp)
    d.update(n_inner=c.ff_dim, eos_token_id=list(c.eos_token_id) or None,
             activation_function=act, scale_attn_weights=c.attention_scale is None,
             model_type="gpt2", architectures=["GPT2LMHeadModel"])
    return d


def gpt2_weights(c: DecoderLMConfig) -> WeightMap:
    """``transformer.`` (optional) + GPT-2's names; ``Conv1D`` weights transposed."""
    names: dict[str, str | tuple[str, ...]] = {
        f"{PREFIX}wte.weight": "embed_tokens.weight",
        f"{PREFIX}wpe.weight": "embed_positions.weight",
        f"{PREFIX}ln_f.weight": "norm.weight", f"{PREFIX}ln_f.bias": "norm.bias"}
    layer = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
             "attn.c_proj": "self_attn.o_proj", "mlp.c_fc": "mlp.linear1",
             "mlp.c_proj": "mlp.linear2"}
    for part in ("weight", "bias"):
        names.update({f"{PREFIX}h.{{}}.{theirs}.{part}": f"layers.{{}}.{ours}.{part}"
                      for theirs, ours in layer.items()})
        names[f"{PREFIX}h.{{}}.attn.c_attn.{part}"] = tuple(
            f"layers.{{}}.self_attn.{p}_proj.{part}" for p in "qkv")
    if not c.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    conv1d = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    return WeightMap(names, transposed=frozenset(f"{PREFIX}h.{{}}.{n}.weight" for n in conv1d),
                     ignored=frozenset(f"{PREFIX}h.{{}}.attn.{n}" for n in ("bias", "masked_bias")),
                     optional_prefix=PREFIX)


def tiny_config(**overrides: Any) -> DecoderLMConfig:
    """A tiny GPT-2 (``E = 32``, 4 heads, 2 layers, ``V = 96``, 128 positions) for tests of
    code that runs on every family; ``overrides`` are ``config.json`` keys (``n_embd=48``)."""
    d = {"vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128,
         "bos_token_id": 1, "eos_token_id": 2}
    return read_gpt2({**d, **overrides})


# Published shapes (the models' config.json): GPT-2 and its medium, large and XL sizes.
PRESETS = {
    name: {"vocab_size": 50257, "n_embd": width, "n_layer": layers, "n_head": heads,
           "n_positions": 1024, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
           "bos_token_id": 50256, "eos_token_id": 50256}
    for name, width, layers, heads in (("gpt2", 768, 12, 12), ("gpt2-medium", 1024, 24, 16),
                                       ("gpt2-large", 1280, 36, 20), ("gpt2-xl", 1600, 48, 25))
}

FAMILY = Family(name="gpt2", model_types=("gpt2",), architecture="GPT2LMHeadModel",
                config_from_hf=read_gpt2, config_to_hf=write_gpt2, weights=gpt2_weights,
                presets=PRESETS)
