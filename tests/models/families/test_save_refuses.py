"""``save_pretrained`` of a family model refuses, before writing anything, a config that its
family's ``config.json`` cannot hold (one that would read back as another model), naming the
field; every family's tiny config saves and reads back as itself."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attnlab.models import DecoderLM, from_pretrained, save_pretrained
from attnlab.models.families import FAMILIES

# Keys each family reads (those it does not know it ignores); Phi-3 turns half the features.
TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 64, "n_embd": 32, "n_layer": 1, "n_head": 4,
        "n_positions": 64}
STYLE = {"mistral": {"sliding_window": 4}, "phi3": {"partial_rotary_factor": 0.5}}
NAMES = sorted(FAMILIES)


def tiny(name: str):
    return FAMILIES[name].config_from_hf({**TINY, **STYLE.get(name, {})})


@pytest.mark.parametrize("name", NAMES)
def test_every_family_tiny_config_saves_and_reads_back(tmp_path, name) -> None:
    torch.manual_seed(0)
    model = DecoderLM(tiny(name))
    save_pretrained(model, tmp_path)
    again = from_pretrained(tmp_path)
    assert again.config.family == name
    assert {k: t.shape for k, t in again.state_dict().items()} == {
        k: t.shape for k, t in model.state_dict().items()}
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(again(ids), model(ids))


@pytest.mark.parametrize("name", NAMES)
def test_save_refuses_a_config_that_reads_back_as_another_model(tmp_path, name) -> None:
    # q/k norms are Qwen3's alone: any other format drops them, Qwen3's always has them.
    c = tiny(name)
    c = replace(c, qk_norm=not c.qk_norm)
    with pytest.raises(ValueError, match=rf"qk_norm: the {name} format cannot hold "
                                         rf"{c.qk_norm} \(it reads back as {not c.qk_norm}\)"):
        save_pretrained(DecoderLM(c), tmp_path / "out")
    assert not (tmp_path / "out").exists()

