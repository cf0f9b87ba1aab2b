"""Config fields are type-checked from the dataclass hints, and errors name the file."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.models import DecoderLMConfig, TransformerConfig
from attnlab.models.config import check_value

TINY = {"src_vocab_size": 11, "tgt_vocab_size": 11, "d_model": 8, "num_heads": 2,
        "num_encoder_layers": 1, "num_decoder_layers": 1, "d_ff": 16, "max_len": 16}


@pytest.mark.parametrize(("field", "value", "error", "expected"), [
    ("norm_first", "no", TypeError, "expected a bool"),          # was read as True
    ("tie_output", 0, TypeError, "expected a bool"),              # an int is not a bool
    ("d_model", True, TypeError, "expected an int"),              # a bool is not an int
    ("d_model", 8.0, TypeError, "expected an int"),
    ("d_model", None, TypeError, "expected an int"),              # null for a required int
    ("d_model", "8", TypeError, "expected an int"),
    ("d_model", -8, ValueError, "expected a positive int"),
    ("d_model", 0, ValueError, "expected a positive int"),
    ("d_model", 9, ValueError, "expected a multiple of num_heads"),
    ("dropout", "0.1", TypeError, "expected a finite number"),
    ("dropout", math.nan, ValueError, "expected a finite number"),
    ("layer_norm_eps", math.inf, ValueError, "expected a finite number"),
    ("layer_norm_eps", 0, ValueError, "expected a positive number"),
    ("activation", "tanh", ValueError, r"expected one of \('relu', 'gelu'\)"),
    ("backend", "cuda", ValueError, "expected one of"),
    ("final_norm", "yes", TypeError, r"expected a bool \(true/false\) or null"),
    ("pad_id", False, TypeError, "expected an int or null"),
    ("pad_id", [0], TypeError, "expected an int or null"),
    ("d_ff", {"size": 8}, TypeError, "expected an int"),
])
def test_transformer_config_file_with_wrong_types(tmp_path, field, value, error, expected) -> None:
    path = tmp_path / "model.json"
    path.write_text(json.dumps({**TINY, field: value}))
    with pytest.raises(error, match=rf"^{path}: {field}: {expected}"):
        TransformerConfig.from_json(path)


def test_from_dict_names_the_source_and_keeps_types() -> None:
    with pytest.raises(TypeError, match=r"^ckpt/config\.json: bias: expected a bool"):
        DecoderLMConfig.from_dict({"vocab_size": 5, "bias": "false"}, source="ckpt/config.json")
    with pytest.raises(TypeError, match=r"^bias: expected a bool"):  # no source: the field
        DecoderLMConfig.from_dict({"vocab_size": 5, "bias": "false"})
    with pytest.raises(ValueError, match=r"^f\.json: missing DecoderLMConfig field "
                       r"'vocab_size'"):
        DecoderLMConfig.from_dict({"d_model": 8}, source="f.json")
    with pytest.raises(TypeError, match=r"^f\.json: expected a mapping .* got list"):
        DecoderLMConfig.from_dict([1, 2], source="f.json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"f\.json: position: expected one of \('learned', "
                       r"'rope'\), got 'alibi'"):
        DecoderLMConfig.from_dict({"vocab_size": 5, "position": "alibi"}, source="f.json")
    # An int is accepted for a float field and stored as a float: the round trip is exact.
    config = DecoderLMConfig.from_dict({"vocab_size": 5, "rope_base": 500, "norm_eps": 1})
    assert type(config.rope_base) is float and config.rope_base == 500.0
    assert DecoderLMConfig.from_json(config.to_json()) == config


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(TypeError, match="tie_embeddings: expected a bool"):
        DecoderLMConfig(vocab_size=5, tie_embeddings="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="vocab_size: expected an int, got True"):
        DecoderLMConfig(vocab_size=True)
    for heads in ("abc", None, 4.5):  # was int(heads): a bare ValueError or a silent 4
        with pytest.raises(ValueError, match="num_heads: expected a positive int"):
            DecoderLMConfig.llama(10, num_heads=heads)


def test_bad_json_text_and_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="text_or_path: not valid JSON"):
        DecoderLMConfig.from_json('{"vocab_size": 5,')
    bad = tmp_path / "c.json"
    bad.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"c\.json: not valid JSON"):
        DecoderLMConfig.from_json(bad)
    bad.write_text("[" * 100_000 + "]" * 100_000)  # deep nesting: RecursionError inside json
    with pytest.raises(ValueError, match=r"c\.json: not valid JSON"):
        DecoderLMConfig.from_json(bad)
    with pytest.raises(FileNotFoundError, match="no such file"):
        DecoderLMConfig.from_json(tmp_path / "none.json")


@pytest.mark.parametrize(("hint", "value", "expected"), [
    (float, 3, 3.0), (float, 2.5, 2.5), (int | None, None, None), (int | None, 4, 4),
    (tuple[int, ...], [1, 2], (1, 2)), (tuple[int, str], [1, "a"], (1, "a")),
    (list[float], (1, 2), [1.0, 2.0]), (Literal["a", "b"], "b", "b"), (str, "x", "x"),
])
def test_check_value_accepts_and_normalises(hint, value, expected) -> None:
    got = check_value("f", value, hint)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(("hint", "value", "error"), [
    (tuple[int, ...], [1, True], r"f\[1\]: expected an int"),
    (tuple[int, ...], "12", "f: expected a list, each item an int"),
    (tuple[int, str], [1], r"f: expected a list of 2"),
    (Literal[1, 2], True, r"f: expected one of \(1, 2\)"),  # True == 1, yet not a choice
    (float, 10 ** 400, "f: expected a finite number"),      # too large for a float
    (float, False, "f: expected a finite number"),
    (type(None), 0, "f: expected null"),
])
def test_check_value_refuses(hint, value, error) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        check_value("f", value, hint)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from([f.name for f in dataclasses.fields(DecoderLMConfig)]), value=JSON)
def test_any_json_value_is_accepted_with_its_type_or_refused_clearly(field, value) -> None:
    """Property: a config built from any JSON value holds exactly the hinted type, or the
    read raises a TypeError/ValueError naming the field (never another exception)."""
    data = {"vocab_size": 7, "d_model": 8, "num_heads": 2, field: value}
    try:
        config = DecoderLMConfig.from_dict(data, source="cfg.json")
    except (TypeError, ValueError) as error:
        assert str(error).startswith("cfg.json: ")
        return
    hints = typing.get_type_hints(DecoderLMConfig)
    stored = getattr(config, field)
    assert check_value(field, stored, hints[field]) == stored
    if isinstance(stored, float):
        assert math.isfinite(stored) and not isinstance(value, bool)
    if isinstance(stored, bool):
        assert value is stored  # no truthiness: only a JSON true/false reads as a bool
