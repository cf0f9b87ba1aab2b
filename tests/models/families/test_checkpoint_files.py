"""Checkpoint folders read by ``from_pretrained``: our save/load round trip and memory mapping,
and folders that are missing, Hub names, corrupt, inconsistent or hostile (bad shards, path
traversal in a sharded index, missing, extra, misshapen or wrongly typed tensors): each a clear
error naming the file and the tensor, never a bare library traceback.

Ported from tests/models/test_qwen2_loading.py and test_hf_files.py (Qwen2ForCausalLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.models import DecoderLM, from_pretrained, save_pretrained
from attnlab.models.families import family_for
from attnlab.models.hf_loading import check_folder
from attnlab.models.io import read_config
from attnlab.tokenizer import Tokenizer

HF_CONFIG = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32,
             "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 64}
CONFIG = family_for("qwen2").config_from_hf(HF_CONFIG)
WEIGHTS = "model.safetensors"


def model(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(CONFIG).eval()


@pytest.fixture
def folder(tmp_path):
    return save_pretrained(model(), tmp_path / "ckpt")


def rewrite(folder, change) -> None:
    tensors = load_file(folder / WEIGHTS)
    change(tensors)
    save_file(tensors, folder / WEIGHTS)


def test_save_load_round_trip_and_memory_map(folder) -> None:
    original = model()
    loaded = from_pretrained(folder, kernels=False)  # the reference modules: bit for bit
    assert loaded.config == CONFIG and not loaded.training
    assert all(p.requires_grad for p in loaded.parameters())
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(original(ids), loaded(ids))
    maps = open("/proc/self/maps").read()  # noqa: SIM115
    assert str(folder / WEIGHTS) in maps  # weights are mapped, not read
    half = from_pretrained(folder, dtype="bfloat16")
    assert half.lm_head.weight.dtype == torch.bfloat16
    assert from_pretrained(folder, device="cpu").lm_head.weight.device.type == "cpu"


def test_transformers_reads_our_checkpoint(folder) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ours = from_pretrained(folder)
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() < 1e-5


def test_missing_folder_config_or_weights(tmp_path, folder) -> None:
    missing = tmp_path / "nonexist"
    for load in (from_pretrained, Tokenizer.from_pretrained, read_config):
        with pytest.raises(FileNotFoundError, match=rf"^{missing}: no such folder; expected a "
                           "folder holding"):
            load(missing)
    (tmp_path / "file").write_text("x")
    for load in (from_pretrained, Tokenizer.from_pretrained):
        with pytest.raises(FileNotFoundError, match=r"file: not a folder"):
            load(tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json: no such file"):
        from_pretrained(empty)
    (folder / WEIGHTS).unlink()
    with pytest.raises(FileNotFoundError, match=r"no weights; expected model\.safetensors"):
        from_pretrained(folder)


def test_hub_name_says_only_local_folders_are_read(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the name is not a folder here
    name = "Qwen/Qwen2.5-0.5B-Instruct"
    for load in (from_pretrained, Tokenizer.from_pretrained):
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
    run = subprocess.run([sys.executable, "-m", "attnlab", "generate", "--model",
                          "nonexist", "--prompt", "hi"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=600)
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
        from_pretrained(folder)


def test_truncated_tensor_data_names_the_file(folder) -> None:
    """A file cut inside the tensor data (the header intact) is refused, not read short."""
    path = folder / WEIGHTS
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=rf"^{path}: not a readable safetensors file"):
        from_pretrained(folder)


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
    reference = from_pretrained(folder)
    shard(folder, {"lm_head.weight": "b.safetensors"})
    sharded = from_pretrained(folder)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(sharded(ids), reference(ids))
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    (folder / "b.safetensors").unlink()  # the index names a shard that is missing
    with pytest.raises(FileNotFoundError, match=r"index\.json: tensor 'lm_head\.weight' is in "
                       r"shard 'b\.safetensors', which does not exist"):
        from_pretrained(folder)
    # The index names a shard that exists but does not hold the tensor.
    index.write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": "a.safetensors"}}))
    with pytest.raises(ValueError, match=r"index\.json: tensor 'lm_head\.weight' is listed in "
                       r"shard 'a\.safetensors', which does not hold it"):
        from_pretrained(folder)
    for bad in ("../a.safetensors", "/etc/passwd", "sub/a.safetensors", "..", 3, "", None):
        index.write_text(json.dumps({"weight_map": {**weight_map, "lm_head.weight": bad}}))
        with pytest.raises(ValueError, match=r"index\.json: tensor 'lm_head\.weight' is in "
                           r"shard .*expected the name of a file in the checkpoint folder"):
            from_pretrained(folder)
    for bad_index in ({"weight_map": []}, {"weight_map": {}}, {}, [weight_map], "x"):
        index.write_text(json.dumps(bad_index))
        with pytest.raises(ValueError, match=rf"^{index}: expected"):
            from_pretrained(folder)


def test_wrong_shape_dtype_extra_and_missing_tensors(folder) -> None:
    path = folder / WEIGHTS
    good = load_file(path)
    cases = [
        ({**good, "model.norm.weight": torch.ones(31)},
         r"tensor 'model\.norm\.weight' has shape \(31,\), expected \(32,\)"),
        ({**good, "model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)},
         r"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(8, 32\), expected "
         r"\(16, 32\)"),
        ({**good, "model.norm.weight": torch.ones(32, dtype=torch.float64)},
         r"tensor 'model\.norm\.weight' has dtype F64"),
        ({**good, "model.norm.weight": torch.ones(32, dtype=torch.int8)},
         r"tensor 'model\.norm\.weight' has dtype I8"),
        ({**good, "model.norm.weight": torch.ones(32, dtype=torch.bool)},
         r"tensor 'model\.norm\.weight' has dtype BOOL"),
        ({**good, "model.extra.weight": torch.zeros(3)},
         r"unexpected tensor 'model\.extra\.weight'"),
        ({**good, "model.layers.2.mlp.up_proj.weight": torch.ones(48, 32)},
         r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"),
        ({k: v for k, v in good.items() if k != "lm_head.weight"},
         r"missing tensor 'lm_head\.weight' \(expected shape \(64, 32\)\)"),
        ({k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"},
         r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight' \(expected shape \(48, 32\)\)"),
        ({k: v for k, v in good.items() if k != "model.layers.1.self_attn.q_proj.bias"},
         r"missing tensor 'model\.layers\.1\.self_attn\.q_proj\.bias'"),
    ]
    for tensors, message in cases:
        save_file(tensors, path)
        with pytest.raises(ValueError, match=rf"^{path}: .*{message}"):
            from_pretrained(folder)


def test_old_rotary_buffers_are_skipped(folder) -> None:
    """Old Llama checkpoints store each layer's ``rotary_emb.inv_freq``: recomputed, not read."""
    reference = from_pretrained(folder)
    rewrite(folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq":
                                        torch.full((4,), 7.0)}))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(from_pretrained(folder)(ids), reference(ids))


def test_unsupported_dtype_and_device_arguments(folder) -> None:
    with pytest.raises(ValueError, match=r"dtype: expected one of .*got torch\.int64"):
        from_pretrained(folder, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"dtype: expected one of .*got 'float64'"):
        from_pretrained(folder, dtype="float64")
    with pytest.raises(ValueError, match=r"device: expected a device such as 'cpu'"):
        from_pretrained(folder, device="gpu:x")
    with pytest.raises(TypeError, match=r"device: expected a str or torch\.device, got int"):
        from_pretrained(folder, device=0)


def test_more_layers_than_stored_tensors_is_refused_before_building(folder) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 12}))
    with pytest.raises(ValueError, match=r"config\.json: asks for 1000000000000 layers, but "
                       r"the weights hold only 27 tensors"):
        from_pretrained(folder)


def test_forward_errors() -> None:
    lm = model()
    with pytest.raises(ValueError, match="input_ids: expected integer token ids"):
        lm(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"attention_mask: expected shape B x \(offset \+ L\)"):
        lm(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4))
    with pytest.raises(ValueError, match="exceed the model's max_len=64"):
        lm(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="logits_to_keep: expected an int >= 0"):
        lm(torch.zeros(1, 3, dtype=torch.long), logits_to_keep=-1)


def _message(fn, *args) -> str:
    try:
        fn(*args)
    except (FileNotFoundError, ValueError) as error:
        return str(error)
    return ""
