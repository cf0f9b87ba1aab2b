"""Hugging Face config.json: read as transformers reads it, and hostile values refused clearly."""

from __future__ import annotations

import dataclasses
import json
import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.models.config import check_value
from attnlab.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

CONFIG = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     eos_token_id=(3,))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    Qwen2ForCausalLM(CONFIG).save_pretrained(folder)
    return folder, json.loads((folder / "config.json").read_text())


def write(folder, config: dict) -> None:
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_transformers_config_json_reads_the_same(tmp_path, model_type) -> None:
    """Reference: the values transformers writes and reads back are the values we read."""
    transformers = pytest.importorskip("transformers")
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[model_type]
    ref = cls(vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=100,
              rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=[2, 4])
    ref.save_pretrained(tmp_path)
    ref = cls.from_pretrained(tmp_path)
    ours = Qwen2Config.from_hf(tmp_path)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                 "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "model_type"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.eos_token_id == (2, 4) and ours.head_dim == 4
    assert ours.rope_theta == 10000.0 and ours.torch_dtype == "float32"


@pytest.mark.parametrize(("key", "value", "error", "message"), [
    # The three: a string "false" was read as True (the stored lm_head ignored).
    ("tie_word_embeddings", "false", TypeError, "tie_word_embeddings: expected a bool"),
    ("eos_token_id", "2", TypeError, "eos_token_id: expected an int, a list of ints or null"),
    ("eos_token_id", [2, True], TypeError, r"eos_token_id\[1\]: expected an int"),
    ("eos_token_id", 64, ValueError, r"eos_token_id: expected ids in \[0, vocab_size=64\)"),
    ("bos_token_id", -1, ValueError, r"bos_token_id: expected ids in \[0, vocab_size=64\)"),
    ("mlp_bias", 1, TypeError, "mlp_bias: expected a bool"),
    ("num_attention_heads", 6, ValueError, "hidden_size: expected a multiple of "
                                           "num_attention_heads=6"),
    ("num_key_value_heads", 3, ValueError, "num_key_value_heads: expected a divisor"),
    ("hidden_size", 0, ValueError, "hidden_size: expected a positive int"),
    ("intermediate_size", -48, ValueError, "intermediate_size: expected a positive int"),
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
    ("rope_scaling", [1, 2], TypeError, "rope_scaling: expected"),
    ("rope_parameters", {"rope_type": 3}, TypeError, "rope_type: expected a string"),
    ("hidden_act", ["silu"], TypeError, "hidden_act: expected a string"),
    ("use_sliding_window", "false", TypeError, "use_sliding_window: expected a bool"),
    ("torch_dtype", "float64", ValueError, "torch_dtype: expected one of"),
    ("torch_dtype", 32, TypeError, "torch_dtype: expected a string"),
    ("dtype", "int4", ValueError, "torch_dtype: expected one of"),
    ("model_type", None, ValueError, "model_type: expected one of"),
])
def test_hostile_values_name_file_and_key(saved, tmp_path, key, value, error, message) -> None:
    config = saved[1]
    config = {k: v for k, v in config.items() if k != "head_dim"}  # D = hidden_size / H
    write(tmp_path, {**config, key: value})
    with pytest.raises(error, match=rf"^{tmp_path / 'config.json'}: {message}"):
        Qwen2Config.from_hf(tmp_path)


def test_eos_int_or_list_is_a_tuple_of_ints(saved, tmp_path) -> None:
    config = saved[1]
    for value, expected in ((5, (5,)), ([5, 7], (5, 7)), (None, ())):
        write(tmp_path, {**config, "eos_token_id": value})
        assert Qwen2Config.from_hf(tmp_path).eos_token_id == expected
    assert Qwen2Config(**{**vars(CONFIG), "eos_token_id": [1, 2]}).eos_token_id == (1, 2)


def test_unknown_and_unicode_keys_are_ignored_as_transformers_does(saved, tmp_path) -> None:
    folder, config = saved
    write(tmp_path, {**config, "ключ": {"nested": [1, {"x": None}]}, "sliding_window": None,
                     "use_sliding_window": False, "rope_scaling": None})
    assert Qwen2Config.from_hf(tmp_path) == Qwen2Config.from_hf(folder)


def test_stored_head_is_used_unless_tied(saved, tmp_path) -> None:
    """``tie_word_embeddings: false`` keeps the stored lm_head (a string no longer flips it)."""
    folder, _ = saved
    model = Qwen2ForCausalLM.from_pretrained(folder)
    assert not model.config.tie_word_embeddings
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_huge_max_position_embeddings_is_a_clear_error(saved, tmp_path) -> None:
    folder, config = saved
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    write(tmp_path, {**config, "max_position_embeddings": 10 ** 13})  # tensors fit: RoPE not
    with pytest.raises(ValueError, match=r"config\.json: max_position_embeddings=10000000000000 "
                       r"is too large"):
        Qwen2ForCausalLM.from_pretrained(tmp_path)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2 ** 70) | st.floats()
                    | st.text(max_size=4), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=5)
KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
        "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
        "torch_dtype", "dtype", "model_type", "bos_token_id", "eos_token_id", "hidden_act",
        "rope_parameters", "rope_scaling", "use_sliding_window", "initializer_range"]


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(KEYS), value=JSON)
def test_any_config_json_value_reads_typed_or_raises_clearly(tmp_path_factory, key, value):
    """Property: whatever JSON a config.json key holds, the config read has the hinted types
    (and bools only from JSON true/false), or the read raises a TypeError/ValueError naming
    the file; never another exception."""
    folder = tmp_path_factory.mktemp("cfg")
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 1, "num_attention_heads": 4, "model_type": "llama"}
    write(folder, {**base, key: value})
    try:
        config = Qwen2Config.from_hf(folder)
    except (TypeError, ValueError) as error:
        assert str(error).startswith(f"{folder / 'config.json'}: ")
        return
    hints = typing.get_type_hints(Qwen2Config)
    for f in dataclasses.fields(config):
        stored = getattr(config, f.name)
        assert check_value(f.name, stored, hints[f.name]) == stored, f.name
    if key in ("tie_word_embeddings", "mlp_bias", "attention_bias"):
        assert value is None or type(value) is bool
