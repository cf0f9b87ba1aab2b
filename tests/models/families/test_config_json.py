"""Hugging Face config.json: read as transformers reads it (each family's defaults included),
and hostile values refused clearly, naming the file and the key.

Ported from tests/models/test_hf_config.py (Qwen2Config.from_hf is now io.read_config).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.models import DecoderLM, DecoderLMConfig, from_pretrained, save_pretrained
from attnlab.models.config import check_value
from attnlab.models.families import FAMILIES, family_for
from attnlab.models.io import read_config

HF = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
      "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 64, "eos_token_id": 3}
CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
           "qwen3": "Qwen3Config"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    save_pretrained(DecoderLM(family_for("qwen2").config_from_hf(HF)), folder)
    return folder, json.loads((folder / "config.json").read_text())


def write(folder, config: object) -> None:
    (folder / "config.json").write_text(json.dumps(config))


def config_of(folder) -> DecoderLMConfig:
    return read_config(folder)[1]


@pytest.mark.parametrize("model_type", list(CLASSES))
def test_transformers_config_json_reads_the_same(tmp_path, model_type) -> None:
    """Reference: the values transformers writes and reads back are the values we read."""
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, CLASSES[model_type])
    ref = cls(vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=100,
              rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=[2, 4],
              head_dim=4)
    ref.save_pretrained(tmp_path)
    ref = cls.from_pretrained(tmp_path)
    _assert_same(config_of(tmp_path), ref)


@pytest.mark.parametrize("model_type", list(CLASSES))
def test_absent_keys_take_transformers_defaults(tmp_path, model_type) -> None:
    """Only the required keys: num_key_value_heads (Qwen 32, Mistral 8, Llama H), head_dim
    (Qwen3 128), max_position_embeddings, token ids, sliding window are transformers'."""
    transformers = pytest.importorskip("transformers")
    minimal = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 48,
               "num_hidden_layers": 1, "num_attention_heads": 32}
    ref = getattr(transformers, CLASSES[model_type])(**minimal)
    write(tmp_path, {"model_type": model_type, **minimal})
    ours = config_of(tmp_path)
    _assert_same(ours, ref)
    assert ours.sliding_window == getattr(ref, "sliding_window", None)


def _assert_same(ours: DecoderLMConfig, ref: object) -> None:
    pairs = {"vocab_size": "vocab_size", "d_model": "hidden_size", "ff_dim": "intermediate_size",
             "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "max_len": "max_position_embeddings", "norm_eps": "rms_norm_eps",
             "tie_embeddings": "tie_word_embeddings", "bos_token_id": "bos_token_id"}
    # transformers' Qwen2 attention reads getattr(config, "head_dim", hidden // heads).
    default_head_dim = ref.hidden_size // ref.num_attention_heads
    for mine, theirs in pairs.items():
        assert getattr(ours, mine) == getattr(ref, theirs, default_head_dim), theirs
    eos = ref.eos_token_id
    assert ours.eos_token_id == (() if eos is None else tuple(eos) if isinstance(eos, list)
                                 else (eos,))
    assert ours.rope_base == ref.rope_parameters["rope_theta"]
    assert ours.family == ref.model_type


def test_unsupported_model_type_names_the_supported_ones(saved, tmp_path) -> None:
    config = saved[1]
    for model_type in ("bert", None, 3):
        write(tmp_path, {**config, "model_type": model_type})
        with pytest.raises(ValueError, match=rf"^{tmp_path / 'config.json'}: model_type "
                           rf"{model_type!r} is not supported; expected one of "
                           + re.escape(str(sorted(FAMILIES))) + r" \(Hugging Face families\) or "
                           r"'attnlab_decoder', 'attnlab_transformer' \(attnlab's own\)$"):
            from_pretrained(tmp_path)
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(FAMILIES)


@pytest.mark.parametrize(("key", "value", "error", "message"), [
    # The three: a string "false" was read as True (the stored lm_head ignored).
    ("tie_word_embeddings", "false", TypeError, "tie_word_embeddings: expected a bool"),
    ("eos_token_id", "2", TypeError, "eos_token_id: expected an int or a list"),
    ("eos_token_id", [2, True], TypeError, "eos_token_id: expected an int or a list"),
    ("mlp_bias", 1, TypeError, "mlp_bias: expected a bool"),
    ("num_attention_heads", 6, ValueError, "hidden_size: expected a multiple of "
                                           "num_attention_heads=6"),
    ("num_key_value_heads", 3, ValueError, "num_key_value_heads: expected a divisor of "
                                           "num_attention_heads=4"),
    ("num_hidden_layers", "2", TypeError, "num_hidden_layers: expected an int"),
    ("hidden_size", 0, ValueError, "hidden_size: expected a positive int"),
    ("intermediate_size", -48, ValueError, "intermediate_size: expected a positive int"),
    ("head_dim", 7, ValueError, "head_dim: RoPE needs an even number"),
    ("vocab_size", 64.0, TypeError, "vocab_size: expected an int"),
    ("vocab_size", None, TypeError, "vocab_size: expected an int"),
    ("hidden_size", {"value": 32}, TypeError, "hidden_size: expected an int"),
    ("rms_norm_eps", None, TypeError, "rms_norm_eps: expected a finite number"),
    ("rms_norm_eps", math.nan, ValueError, "rms_norm_eps: expected a finite number"),
    ("rms_norm_eps", -1e-6, ValueError, "rms_norm_eps: expected a positive number"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": math.inf}, ValueError,
     "rope_theta: expected a finite number"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "1e4"}, TypeError,
     "rope_theta: expected a finite number"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 0.5}, ValueError,
     "rope_theta: expected a number > 1"),
    ("rope_scaling", [1, 2], TypeError, "rope_scaling: expected dict or null"),
    ("rope_parameters", {"rope_type": 3}, ValueError, "rope_parameters: rope_type: expected "
                                                      "one of"),
    ("rope_parameters", {"rope_type": "ntk-by-parts", "factor": 2.0}, ValueError,
     r"rope_parameters: rope_type: expected one of \('default', 'linear', 'dynamic', 'yarn', "
     r"'llama3'"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}, ValueError,
     r"rope_parameters: rope_type 'llama3' needs the keys"),
    ("rope_parameters", {"rope_type": "linear", "factor": -2.0}, ValueError,
     "rope_parameters: factor: expected a number > 0"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 0.5}, ValueError,
     "rope_parameters: factor: expected a number >= 1 for dynamic"),
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0, "bogus": 1}, ValueError,
     r"rope_parameters: unsupported keys \['bogus'\]"),
    ("partial_rotary_factor", 0.5, ValueError, "partial_rotary_factor: expected 1.0 for qwen2"),
    ("rope_parameters", {"rope_type": "default", "partial_rotary_factor": "x"}, ValueError,
     "partial_rotary_factor: expected 1.0 for qwen2"),
    ("hidden_act", ["silu"], TypeError, "hidden_act: expected a string"),
    ("hidden_act", "gelu", ValueError, "hidden_act 'gelu' is not supported for qwen2"),
    ("use_sliding_window", "false", TypeError, "use_sliding_window: expected a bool"),
    ("torch_dtype", "float64", ValueError, "torch_dtype: expected one of"),
    ("torch_dtype", 32, TypeError, "torch_dtype: expected a string"),
    ("dtype", "int4", ValueError, "dtype: expected one of"),
])
def test_hostile_values_name_file_and_key(saved, tmp_path, key, value, error, message) -> None:
    config = {k: v for k, v in saved[1].items() if k != "head_dim"}  # D = hidden_size / H
    write(tmp_path, {**config, key: value})
    with pytest.raises(error, match=rf"^{tmp_path / 'config.json'}: {message}"):
        read_config(tmp_path)


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers"])
def test_missing_key_is_named(saved, tmp_path, key) -> None:
    write(tmp_path, {k: v for k, v in saved[1].items() if k != key})
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'config.json'}: missing key {key!r}"):
        read_config(tmp_path)


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]", "expected a JSON object, got list"),
    ('"qwen2"', "expected a JSON object, got str"),
    ("null", "expected a JSON object, got NoneType"),
    ('{"model_type": "qwen2",', "not valid JSON"),
    ("[" * 100_000, "not valid JSON"),
])
def test_non_object_config_json_is_named(tmp_path, text, message) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'config.json'}: {message}"):
        read_config(tmp_path)


def test_transformers_4_rope_scaling_reads_as_rope_parameters(saved, tmp_path) -> None:
    """transformers 4 wrote ``rope_scaling`` (``type`` or ``rope_type``) and a top-level
    ``rope_theta``; 5 writes both inside ``rope_parameters``: the same config either way."""
    config = {k: v for k, v in saved[1].items() if k != "rope_parameters"}
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    write(tmp_path, {**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
                                                   **llama3}})
    new = config_of(tmp_path)
    for old in ({"rope_scaling": {"rope_type": "llama3", **llama3}, "rope_theta": 5e5},
                {"rope_scaling": {"type": "llama3", **llama3}, "rope_theta": 5e5}):
        write(tmp_path, {**config, **old})
        assert config_of(tmp_path) == new
    assert new.rope_scaling.rope_type == "llama3" and new.rope_base == 5e5


def test_eos_int_or_list_is_a_tuple_of_ints(saved, tmp_path) -> None:
    config = saved[1]
    for value, expected in ((5, (5,)), ([5, 7], (5, 7)), (None, ())):
        write(tmp_path, {**config, "eos_token_id": value})
        assert config_of(tmp_path).eos_token_id == expected


def test_unknown_and_unicode_keys_are_ignored_as_transformers_does(saved, tmp_path) -> None:
    folder, config = saved
    write(tmp_path, {**config, "ключ": {"nested": [1, {"x": None}]}, "sliding_window": None,
                     "use_sliding_window": False, "rope_scaling": None})
    assert config_of(tmp_path) == config_of(folder)


def test_stored_head_is_used_unless_tied(saved) -> None:
    """``tie_word_embeddings: false`` keeps the stored lm_head (a string no longer flips it)."""
    folder, _ = saved
    model = from_pretrained(folder)
    assert not model.config.tie_embeddings
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_huge_max_position_embeddings_allocates_nothing(saved, tmp_path) -> None:
    """RoPE computes cos/sin per forward: a 10^13-position config loads and runs (it was a
    clear error when the tables were precomputed)."""
    folder, config = saved
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    write(tmp_path, {**config, "max_position_embeddings": 10 ** 13})
    huge, plain = from_pretrained(tmp_path), from_pretrained(folder)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(huge(ids), plain(ids))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2 ** 70) | st.floats()
                    | st.text(max_size=4), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=5)
KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
        "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
        "torch_dtype", "dtype", "model_type", "bos_token_id", "eos_token_id", "hidden_act",
        "rope_parameters", "rope_scaling", "use_sliding_window", "sliding_window",
        "layer_types", "initializer_range"]


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(KEYS), value=JSON, model_type=st.sampled_from(sorted(CLASSES)))
def test_any_config_json_value_reads_typed_or_raises_clearly(tmp_path_factory, key, value,
                                                             model_type) -> None:
    """Property: whatever JSON a config.json key holds, the config read has the hinted types
    (and bools only from JSON true/false), or the read raises a TypeError/ValueError naming
    the file; never another exception."""
    folder = tmp_path_factory.mktemp("cfg")
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "model_type": model_type}
    write(folder, {**base, key: value})
    try:
        config = config_of(folder)
    except (TypeError, ValueError) as error:
        assert str(error).startswith(f"{folder / 'config.json'}: ")
        return
    hints = typing.get_type_hints(DecoderLMConfig)
    for f in dataclasses.fields(config):
        stored = getattr(config, f.name)
        assert check_value(f.name, stored, hints[f.name]) == stored, f.name
    if key in ("tie_word_embeddings", "mlp_bias", "attention_bias"):
        assert value is None or type(value) is bool
