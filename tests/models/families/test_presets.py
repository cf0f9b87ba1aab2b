"""``attnlab.models.preset``: published models' shapes by name, each read by its family as its
``config.json`` would be, with the parameter count of transformers' model of the same keys and
of the model's card, and a model of it that transformers reads back."""

from __future__ import annotations

import pytest
import torch

from attnlab.models import PRESETS, DecoderLM, preset, save_pretrained
from attnlab.models.families import FAMILIES
from attnlab.models.families.base import check_round_trip

transformers = pytest.importorskip("transformers")

# The parameter counts the models are published with (tied embeddings counted once).
PUBLISHED = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
             "gpt2-xl": 1_557_611_200, "llama-3.2-1b": 1_235_814_400,
             "llama-3.1-8b": 8_030_261_248, "mistral-7b-v0.1": 7_241_732_096,
             "qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920,
             "gemma-2b": 2_506_172_416, "phi-3-mini-4k": 3_821_079_552}
# transformers' default configs are these models' sizes.
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads")
DEFAULTS = {"gpt2": ("gpt2", ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions")),
            "mistral-7b-v0.1": ("mistral", SIZES), "phi-3-mini-4k": ("phi3", SIZES)}


def test_every_family_has_presets_and_every_preset_is_counted() -> None:
    assert {f.name for f in PRESETS.values()} == {f.name for f in FAMILIES.values()}
    assert set(PUBLISHED) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_has_transformers_and_the_published_parameter_count(name) -> None:
    family = PRESETS[name]
    config = preset(name)
    assert config.family == family.model_types[0]
    check_round_trip(config, family.config_to_hf(config), family.config_from_hf)
    with torch.device("meta"):  # the shapes without the memory
        ours = DecoderLM(config)
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(family.model_types[0], **family.presets[name]))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters()) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(DEFAULTS))
def test_presets_agree_with_transformers_defaults_for_the_same_model(name) -> None:
    model_type, keys = DEFAULTS[name]
    default = transformers.AutoConfig.for_model(model_type)
    values = PRESETS[name].presets[name]
    assert {k: values[k] for k in keys} == {k: getattr(default, k) for k in keys}


@pytest.mark.parametrize(("name", "small"), [
    ("qwen2.5-0.5b", {"num_hidden_layers": 1, "vocab_size": 64, "bos_token_id": 0,
                      "eos_token_id": 0}),
    ("gpt2", {"n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 64,
              "bos_token_id": 0, "eos_token_id": 0}),
    ("llama-3.2-1b", {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 96,
                      "head_dim": 8, "vocab_size": 64, "bos_token_id": 0, "eos_token_id": 1}),
])
def test_a_preset_with_overrides_saves_a_folder_transformers_reads(tmp_path, name, small
                                                                   ) -> None:
    config = preset(name, **small)
    torch.manual_seed(0)
    model = DecoderLM(config).eval()
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_unknown_preset_and_bad_overrides_are_named() -> None:
    with pytest.raises(ValueError, match=r"name: expected one of \['gemma-2b', .*got 'gpt3'"):
        preset("gpt3")
    with pytest.raises(TypeError, match="hidden_size"):
        preset("qwen2.5-0.5b", hidden_size="wide")
    with pytest.raises(ValueError, match="name: expected one of"):
        preset(None)
