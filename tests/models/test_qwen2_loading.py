"""Checkpoint folders: our save/load round trip, memory mapping, and clear errors on bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

CONFIG = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    Qwen2ForCausalLM(CONFIG).save_pretrained(tmp_path)
    return tmp_path


def rewrite(folder, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")


def test_save_load_round_trip_and_memory_map(folder) -> None:
    torch.manual_seed(0)
    original = Qwen2ForCausalLM(CONFIG).eval()
    loaded = Qwen2ForCausalLM.from_pretrained(folder, layout="stored")
    assert loaded.config == CONFIG and not loaded.training
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(original(ids), loaded(ids))
    maps = open("/proc/self/maps").read()  # noqa: SIM115
    assert str(folder / "model.safetensors") in maps  # weights are mapped, not read
    columns = Qwen2ForCausalLM.from_pretrained(folder)  # auto: column-major for float32
    w = columns.layers[0].mlp.down_proj.weight
    assert w.shape == (32, 48) and w.stride() == (1, 32)
    assert torch.equal(w, loaded.layers[0].mlp.down_proj.weight)
    assert columns.embed_tokens.weight.is_contiguous()  # untied: the table keeps its rows
    with torch.no_grad():
        torch.testing.assert_close(columns(ids), loaded(ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layout: expected one of"):
        Qwen2ForCausalLM.from_pretrained(folder, layout="rows")
    half = Qwen2ForCausalLM.from_pretrained(folder, dtype="bfloat16")
    assert half.lm_head.weight.dtype == torch.bfloat16


def test_transformers_reads_our_checkpoint(folder) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = Qwen2ForCausalLM.from_pretrained(folder)
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() < 1e-5


def test_missing_folder_config_or_weights(tmp_path, folder) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        Qwen2ForCausalLM.from_pretrained(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        Qwen2ForCausalLM.from_pretrained(empty)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no weights; expected model\.safetensors"):
        Qwen2ForCausalLM.from_pretrained(folder)


def test_missing_and_unexpected_tensor_names(folder) -> None:
    rewrite(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.safetensors: missing tensor "
                       r"'model\.layers\.1\.mlp\.up_proj\.weight' \(expected shape \(48, 32\)\)"):
        Qwen2ForCausalLM.from_pretrained(folder)
    rewrite(folder, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(48, 32),
                                        "model.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor "
                       r"'model\.extra\.weight'"):
        Qwen2ForCausalLM.from_pretrained(folder)


def test_shape_mismatch_names_file_and_tensor(folder) -> None:
    rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight":
                                        torch.zeros(8, 32)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\."
                       r"self_attn\.k_proj\.weight' has shape \(8, 32\), expected \(16, 32\)"):
        Qwen2ForCausalLM.from_pretrained(folder)


def test_unsupported_dtypes(folder) -> None:
    with pytest.raises(ValueError, match=r"dtype: expected one of .*got torch\.int64"):
        Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.int64)
    rewrite(folder, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int8)}))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.norm\.weight' "
                       r"has dtype I8"):
        Qwen2ForCausalLM.from_pretrained(folder)


def test_sharded_index_errors(folder) -> None:
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"index\.json: tensor 'model\.embed_tokens\."
                       r"weight' is in shard 'model-00001-of-00002\.safetensors'"):
        Qwen2ForCausalLM.from_pretrained(folder)


def test_bad_config(folder) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config\.json: model_type: expected one of "
                       r"\('qwen2', 'llama'\), got 'gpt2'"):
        Qwen2ForCausalLM.from_pretrained(folder)
    scaled = {**config, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}
    (folder / "config.json").write_text(json.dumps(scaled))
    with pytest.raises(ValueError, match=r"config\.json: rope_type 'yarn' is not supported"):
        Qwen2ForCausalLM.from_pretrained(folder)
    del config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: missing key 'hidden_size'"):
        Qwen2ForCausalLM.from_pretrained(folder)


def test_forward_errors() -> None:
    model = Qwen2ForCausalLM(CONFIG)
    with pytest.raises(ValueError, match="input_ids: expected integer token ids"):
        model(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"attention_mask: expected shape B x \(offset \+ L\)"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match="exceed the model's max_position_embeddings=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="logits_to_keep: expected an int >= 0"):
        model(torch.zeros(1, 3, dtype=torch.long), logits_to_keep=-1)
