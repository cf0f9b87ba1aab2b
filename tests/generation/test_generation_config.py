"""generation_config.json reader against transformers' GenerationConfig."""

from __future__ import annotations

import json

import pytest

from attnlab.generation.config import GenerationConfig, read_generation_config

transformers = pytest.importorskip("transformers")

FIELDS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "eos_token_id",
          "pad_token_id", "max_new_tokens", "max_length")


@pytest.mark.parametrize("settings", [
    {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
     "repetition_penalty": 1.05, "eos_token_id": [5, 7], "pad_token_id": 3,
     "max_new_tokens": 9},
    {"eos_token_id": 4, "max_length": 30, "repetition_penalty": 1.2},
    {"top_k": 0, "do_sample": True},
    {},
])
def test_reads_what_transformers_reads(tmp_path, settings: dict) -> None:
    transformers.GenerationConfig(**settings).save_pretrained(tmp_path)
    ours = read_generation_config(tmp_path)
    theirs = transformers.GenerationConfig.from_pretrained(tmp_path)
    for name in FIELDS:
        value = getattr(theirs, name)
        if name == "eos_token_id" and isinstance(value, int):
            value = (value,)
        if name == "eos_token_id" and isinstance(value, list):
            value = tuple(value)
        if name == "top_k" and value == 0:
            value = None  # transformers: top_k 0 turns the filter off
        assert getattr(ours, name) == value, name
    assert ours.path == str(tmp_path / "generation_config.json")


def test_missing_file_sets_nothing(tmp_path) -> None:
    config = read_generation_config(tmp_path)
    assert all(getattr(config, name) is None for name in FIELDS)


@pytest.mark.parametrize(("text", "message"), [
    ('{"do_sample": "yes"}', "do_sample: expected true or false, got 'yes'"),
    ('{"temperature": -1}', "temperature: expected a finite number >= 0, got -1"),
    ('{"temperature": NaN}', "expected a JSON object of generation settings, got invalid JSON"),
    ('{"temperature": true}', "temperature: expected a finite number >= 0, got True"),
    ('{"top_k": 2.5}', "top_k: expected an int >= 0, got 2.5"),
    ('{"top_p": 0}', r"top_p: expected a number in \(0, 1\], got 0"),
    ('{"repetition_penalty": 0}', "repetition_penalty: expected a finite number > 0, got 0"),
    ('{"eos_token_id": [1, true]}', r"eos_token_id: expected a token id .*got \[1, True\]"),
    ('{"eos_token_id": []}', "eos_token_id: expected a token id"),
    ('{"eos_token_id": "2"}', "eos_token_id: expected a token id"),
    ('{"pad_token_id": -1}', "pad_token_id: expected a token id"),
    ('{"max_new_tokens": "9"}', "max_new_tokens: expected an int >= 0, got '9'"),
    ('[1, 2]', "expected a JSON object of generation settings, got list"),
    ('{"do_sample": tru', "invalid JSON"),
])
def test_bad_fields_name_the_field_and_the_file(tmp_path, text: str, message: str) -> None:
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        read_generation_config(tmp_path)
    assert str(error.value).startswith(str(tmp_path / "generation_config.json"))


def test_is_frozen_and_unknown_fields_are_ignored(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"transformers_version": "5.0", "bos_token_id": 1, "top_k": 3, "top_p": None}))
    config = read_generation_config(tmp_path)
    assert config.top_k == 3 and config.top_p is None
    with pytest.raises(AttributeError):
        config.top_k = 4  # type: ignore[misc]
    assert GenerationConfig(eos_token_id=[1, 2]).eos_token_id == (1, 2)
