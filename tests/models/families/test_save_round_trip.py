"""``save_pretrained`` in each family's format: transformers reads our save back to the same
logits, our load of our save gives identical tensors and config, and ``rope_parameters``
holds only the keys of its rope type (transformers warns about any other)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from family_parity import V, left_padded_batch, tiny_checkpoint

from attnlab.models import from_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")

SIZES = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
         "initializer_range": 0.1}
ROPE = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 2.0,
        "original_max_position_embeddings": 16}
# name -> (config class, model class, overrides)
CASES = {
    "llama-yarn-bias": ("LlamaConfig", "LlamaForCausalLM",
                        {"attention_bias": True, "mlp_bias": True, "rope_parameters": ROPE}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "attention_bias": True}),
}


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    config_cls, model_cls, overrides = CASES[request.param]
    theirs = tmp_path_factory.mktemp(f"{request.param}-hf")
    tiny_checkpoint(theirs, getattr(transformers, model_cls),
                    getattr(transformers, config_cls)(**SIZES, **overrides))
    ours = from_pretrained(theirs)
    folder = save_pretrained(ours, tmp_path_factory.mktemp(f"{request.param}-ours"))
    return theirs, ours, folder


def test_transformers_reads_our_save_to_the_same_logits(saved, caplog) -> None:
    _, ours, folder = saved
    with caplog.at_level(logging.WARNING):
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert not [r for r in caplog.records if "nrecognized" in r.getMessage()], caplog.text
    assert type(hf).__name__ == CASES[_case(folder)][1]
    ids, mask = left_padded_batch(5)
    with torch.no_grad():
        err = (hf(input_ids=ids, attention_mask=mask).logits - ours(ids, mask))[mask.bool()]
    assert err.abs().max() < 1e-4


def test_our_load_of_our_save_is_identical(saved) -> None:
    theirs, ours, folder = saved
    again = from_pretrained(folder)
    assert again.config == ours.config
    assert again.state_dict().keys() == ours.state_dict().keys()
    for name, t in ours.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name
    stored = json.loads((theirs / "config.json").read_text())
    written = json.loads((folder / "config.json").read_text())
    stored, written = stored["rope_parameters"], written["rope_parameters"]
    assert {k: written.get(k) for k in stored} == stored  # plus optional keys' defaults


@pytest.mark.parametrize(("rope", "keys"), [
    ({"rope_type": "linear", "factor": 2.0}, {"factor"}),
    ({"rope_type": "dynamic", "factor": 2.0}, {"factor"}),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8},
     {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    ({"rope_type": "yarn", "factor": 2.0}, {"factor", "original_max_position_embeddings",
                                            "beta_fast", "beta_slow", "truncate"}),
    ({"rope_type": "default"}, set()),
])
def test_rope_parameters_hold_only_their_type_keys(tmp_path, rope, keys) -> None:
    config = transformers.LlamaConfig(**SIZES, rope_parameters={"rope_theta": 500.0, **rope})
    tiny_checkpoint(tmp_path / "hf", transformers.LlamaForCausalLM, config)
    ours = from_pretrained(tmp_path / "hf")
    save_pretrained(ours, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert set(written["rope_parameters"]) == {"rope_type", "rope_theta", *keys}
    assert written["max_position_embeddings"] == 32  # dynamic: M again, not factor x M
    reread = transformers.AutoConfig.from_pretrained(tmp_path / "ours")
    for key, value in rope.items():
        assert reread.rope_parameters[key] == value, key
    assert from_pretrained(tmp_path / "ours").config == ours.config


def _case(folder) -> str:
    return next(name for name in CASES if folder.name.startswith(f"{name}-ours"))
