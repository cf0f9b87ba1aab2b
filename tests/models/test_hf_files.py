"""Checkpoint folders that are missing, Hub names, corrupt or inconsistent safetensors files:
each a clear error naming the folder or file, never a bare library traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.models.hf_loading import check_folder
from attnlab.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from attnlab.tokenizer import Tokenizer

CONFIG = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
WEIGHTS = "model.safetensors"


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    Qwen2ForCausalLM(CONFIG).save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_missing_folder_says_so(tmp_path) -> None:
    missing = tmp_path / "nonexist"
    for load in (Qwen2ForCausalLM.from_pretrained, Tokenizer.from_pretrained,
                 Qwen2Config.from_hf):
        with pytest.raises(FileNotFoundError, match=rf"^{missing}: no such folder; expected a "
                           "folder holding"):
            load(missing)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"file: not a folder"):
        Tokenizer.from_pretrained(tmp_path / "file")


def test_hub_name_says_only_local_folders_are_read(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the name is not a folder here
    name = "Qwen/Qwen2.5-0.5B-Instruct"
    for load in (Qwen2ForCausalLM.from_pretrained, Tokenizer.from_pretrained):
        with pytest.raises(FileNotFoundError) as info:
            load(name)
        message = str(info.value)
        assert message.startswith(f"{name}: no such folder. Only local folders are read "
                                  "(nothing is downloaded)")
        assert f"huggingface-cli download {name} --local-dir Qwen2.5-0.5B-Instruct" in message
    assert "Only local" not in _message(check_folder, "./Qwen/x")  # a path, not a Hub name


def test_cli_model_nonexist_reports_the_folder(tmp_path) -> None:
    """``attnlab generate --model nonexist`` used to report a missing tokenizer.json."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run([sys.executable, "-m", "attnlab.cli", "generate", "--model",
                          "nonexist", "--prompt", "hi"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert run.returncode != 0
    assert "nonexist: no such folder" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda raw: raw[:-64], "incomplete metadata"),             # truncated download
    (lambda raw: b"\x00" * 4, "header too small"),
    (lambda raw: b"\xff" * 200, "header too large"),             # invalid header length
    (lambda raw: raw[:8] + b"{not json" + raw[17:], "deserializing header"),
])
def test_corrupt_safetensors_name_the_file(folder, damage, reason) -> None:
    path = folder / WEIGHTS
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=rf"^{path}: not a readable safetensors file "
                       rf"\(.*{reason}.*\); it is truncated or corrupt"):
        Qwen2ForCausalLM.from_pretrained(folder)


def shard(folder, weight_map: dict) -> None:
    """Split the single file into one shard per entry of ``weight_map``'s values."""
    tensors = load_file(folder / WEIGHTS)
    (folder / WEIGHTS).unlink()
    files: dict[str, dict] = {}
    for name, t in tensors.items():
        files.setdefault(weight_map.get(name, "a.safetensors"), {})[name] = t
    for file, part in files.items():
        save_file(part, folder / file)
    full = {name: weight_map.get(name, "a.safetensors") for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": full}))


def test_sharded_folder_loads_and_bad_indexes_are_named(folder) -> None:
    reference = Qwen2ForCausalLM.from_pretrained(folder)
    shard(folder, {"lm_head.weight": "b.safetensors"})
    sharded = Qwen2ForCausalLM.from_pretrained(folder)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(sharded(ids), reference(ids))
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    (folder / "b.safetensors").unlink()  # the index names a shard that is missing
    with pytest.raises(FileNotFoundError, match=r"index\.json: tensor 'lm_head\.weight' is in "
                       r"shard 'b\.safetensors', which does not exist"):
        Qwen2ForCausalLM.from_pretrained(folder)
    # The index names a shard that exists but does not hold the tensor.
    index.write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": "a.safetensors"}}))
    with pytest.raises(ValueError, match=r"index\.json: tensor 'lm_head\.weight' is listed in "
                       r"shard 'a\.safetensors', which does not hold it"):
        Qwen2ForCausalLM.from_pretrained(folder)
    for bad in ("../a.safetensors", "/etc/passwd", 3, ""):  # only files in the folder
        index.write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": bad}}))
        with pytest.raises(ValueError, match=r"index\.json: tensor 'lm_head\.weight' is in "
                           r"shard .*expected the name of a file in the checkpoint folder"):
            Qwen2ForCausalLM.from_pretrained(folder)
    index.write_text(json.dumps({"weight_map": []}))
    with pytest.raises(ValueError, match="expected a non-empty 'weight_map' object"):
        Qwen2ForCausalLM.from_pretrained(folder)


def test_wrong_shape_dtype_extra_and_missing_tensors(folder) -> None:
    path = folder / WEIGHTS
    good = load_file(path)
    cases = [
        ({**good, "model.norm.weight": torch.ones(31)}, ValueError,
         r"tensor 'model\.norm\.weight' has shape \(31,\), expected \(32,\)"),
        ({**good, "model.norm.weight": torch.ones(32, dtype=torch.float64)}, ValueError,
         r"tensor 'model\.norm\.weight' has dtype F64"),
        ({**good, "model.norm.weight": torch.ones(32, dtype=torch.bool)}, ValueError,
         r"tensor 'model\.norm\.weight' has dtype BOOL"),
        ({**good, "model.layers.1.mlp.up_proj.weight": torch.ones(1)}, ValueError,
         r"unexpected tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
        ({k: v for k, v in good.items() if k != "lm_head.weight"}, ValueError,
         r"missing tensor 'lm_head\.weight' \(expected shape \(64, 32\)\)"),
    ]
    for tensors, error, message in cases:
        save_file(tensors, path)
        with pytest.raises(error, match=message):
            Qwen2ForCausalLM.from_pretrained(folder)


def _message(fn, *args) -> str:
    try:
        fn(*args)
    except (FileNotFoundError, ValueError) as error:
        return str(error)
    return ""
