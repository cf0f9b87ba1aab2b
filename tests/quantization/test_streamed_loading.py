"""Quantized loads stream: ``from_pretrained(quantize=)``, ``attnlab quantize`` and loading a
quantized folder build the model on the ``meta`` device and read, quantize and place one
stored tensor at a time. Proven here: the result is bit-identical to quantizing the loaded
float model (every format, dtype and scheme), no float weight of a quantized layer outlives
its quantization (so the float model never exists), no float model is built for a quantized
folder, the wait is announced once on stderr, and a bad weight names its file and tensor."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.cli import main
from attnlab.models.decoder import DecoderLM
from attnlab.models.families import FAMILIES
from attnlab.models.hf_loading import StoredTensor
from attnlab.models.io import from_pretrained, save_pretrained
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.quantization import QuantizedEmbedding, QuantizedLinear, quantize

_QWEN2 = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "initializer_range": 0.2}


def _family_folder(folder, *, tied: bool, dtype: torch.dtype = torch.float32):
    """A Qwen2 folder (q/k/v biases) in the Hugging Face format."""
    config = FAMILIES["qwen2"].config_from_hf({**_QWEN2, "tie_word_embeddings": tied})
    torch.manual_seed(0)
    save_pretrained(DecoderLM(config).to(dtype), folder)
    return folder


def _own_folder(folder):
    """A DecoderLM in attnlab's own format (no family), untied, with biases."""
    config = FAMILIES["qwen2"].config_from_hf({**_QWEN2, "tie_word_embeddings": False})
    config = dataclasses.replace(config, family=None)
    torch.manual_seed(1)
    save_pretrained(DecoderLM(config), folder)
    return folder


def _transformer_folder(folder):
    """attnlab's seq2seq Transformer, its embeddings and output shared (one tied table)."""
    torch.manual_seed(2)
    config = TransformerConfig(40, 40, d_model=64, num_heads=4, num_encoder_layers=1,
                               num_decoder_layers=1, d_ff=128, share_embeddings=True)
    Transformer(config).save_pretrained(folder)
    return folder


FOLDERS = {
    "family tied": lambda f: _family_folder(f, tied=True),
    "family untied bfloat16": lambda f: _family_folder(f, tied=False, dtype=torch.bfloat16),
    "attnlab decoder": _own_folder,
    "attnlab transformer": _transformer_folder,
}


def _inputs(model):
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    return (ids, ids[:, :5]) if isinstance(model, Transformer) else (ids,)


def _assert_same(streamed, reference) -> None:
    """Bit-identical state dicts and outputs, the same quantized modules."""
    ours, theirs = streamed.state_dict(), reference.state_dict()
    assert list(ours) == list(theirs)
    for name, t in ours.items():
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    assert ([type(m).__name__ for m in streamed.modules()]
            == [type(m).__name__ for m in reference.modules()])
    assert streamed.quantization == reference.quantization
    with torch.inference_mode():
        torch.testing.assert_close(streamed(*_inputs(streamed)),
                                   reference(*_inputs(reference)), rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(FOLDERS))
@pytest.mark.parametrize(("method", "group_size", "skip"),
                         [("int8", None, ()), ("int4", 32, ()), ("int4", 64, ("*.mlp.*",))])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_streamed_quantized_load_is_bit_identical_to_quantizing_the_loaded_model(
        tmp_path, kind, method, group_size, skip, dtype) -> None:
    folder = FOLDERS[kind](tmp_path / "float")
    streamed = from_pretrained(folder, dtype=dtype, quantize=method, group_size=group_size,
                               skip=skip)
    reference = from_pretrained(folder, dtype=dtype)  # the float model, then quantized
    reference.quantize(method, group_size, skip=skip)
    _assert_same(streamed, reference)
    if kind == "family tied":  # one table, read by the head and the embedding
        assert streamed.embed_tokens.source is streamed.lm_head
    # the folder `attnlab quantize` writes loads as the same model
    out = tmp_path / "quantized"
    argv = ["quantize", str(folder), str(out), "--bits", method[-1], "--skip", *skip]
    assert main(argv + (["--dtype", dtype] if dtype else [])
                + (["--group-size", str(group_size)] if group_size else [])) == 0
    _assert_same(from_pretrained(out), reference)


@pytest.mark.parametrize("kind", ["family tied", "attnlab decoder"])
def test_no_float_weight_of_a_quantized_layer_outlives_its_quantization(
        tmp_path, monkeypatch, kind) -> None:
    """Each float weight is freed once its layer is quantized, before the next is read: at
    most one lives at a time, so the float model never exists (today's load-then-quantize
    held every one of them until the last was quantized)."""
    folder = FOLDERS[kind](tmp_path)
    seen: list[weakref.ref] = []
    alive_at_each: list[int] = []

    def watching(make):
        def quantize(module, **kwargs):
            alive_at_each.append(sum(ref() is not None for ref in seen))
            seen.append(weakref.ref(module.weight))
            return make(module, **kwargs)
        return quantize

    monkeypatch.setattr(QuantizedLinear, "from_linear", watching(QuantizedLinear.from_linear))
    monkeypatch.setattr(QuantizedEmbedding, "from_embedding",
                        watching(QuantizedEmbedding.from_embedding))
    model = from_pretrained(folder, quantize="int8")
    assert len(seen) == 2 * 7 + 1 + (kind == "attnlab decoder")  # + head (+ own embedding)
    assert alive_at_each == [0] * len(seen)
    assert all(ref() is None for ref in seen)
    assert not any(type(m) in (torch.nn.Linear, torch.nn.Embedding) for m in model.modules())


def test_a_quantized_folder_loads_without_building_a_float_model(tmp_path, monkeypatch) -> None:
    """The model is built on ``meta`` and filled with the stored codes: no float weights are
    made (today's load built the float model with random weights, then overwrote it)."""
    out = tmp_path / "q"
    assert main(["quantize", str(_family_folder(tmp_path / "f", tied=True)), str(out),
                 "--bits", "4", "--group-size", "32"]) == 0
    built_on: list[torch.device] = []
    reset = DecoderLM.reset_parameters

    def recording(self):
        built_on.append(self.lm_head.weight.device)
        reset(self)

    monkeypatch.setattr(DecoderLM, "reset_parameters", recording)
    model = from_pretrained(out)
    assert [d.type for d in built_on] == ["meta"]
    stored = load_file(out / "model.safetensors")
    state = model.state_dict()
    assert sorted(stored) == sorted(state)
    assert all(torch.equal(state[name], t) for name, t in stored.items())


def test_the_wait_is_announced_once_on_stderr(tmp_path, capsys) -> None:
    def announced(line: str) -> None:  # then, on a slow machine, perhaps a progress bar
        err = capsys.readouterr().err
        assert err.startswith(f"attnlab: {line} ...\n") and err.count(line) == 1, err

    folder = _family_folder(tmp_path / "f", tied=True)
    from_pretrained(folder)
    assert capsys.readouterr().err == ""  # a float load maps its tensors: nothing to wait for
    from_pretrained(folder, quantize="int4", group_size=32)
    announced(f"loading 2 layers as int4 (group_size 32, search, tables int8) from {folder}")
    out = tmp_path / "q"
    assert main(["quantize", str(folder), str(out)]) == 0
    announced(f"loading 2 layers as int8 from {folder}")
    from_pretrained(out)
    announced(f"loading 2 int8 layers from {out}")


def test_a_weight_that_is_not_finite_names_its_file_and_tensor(tmp_path) -> None:
    folder = _family_folder(tmp_path, tied=True)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 5] = float("nan")
    save_file(tensors, path)
    for skip in ((), ["*.up_proj"]):  # quantized or kept float, it is refused as it is read
        with pytest.raises(ValueError, match=rf"{path}: tensor '{name}' holds NaN or infinite "
                                             r"values"):
            from_pretrained(folder, quantize="int8", skip=skip)


def test_a_scheme_that_does_not_fit_is_refused_before_a_tensor_is_read(tmp_path,
                                                                        monkeypatch) -> None:
    folder = _family_folder(tmp_path, tied=False)
    monkeypatch.setattr(StoredTensor, "read", lambda self: pytest.fail(f"read {self.name}"))
    with pytest.raises(ValueError, match=r"group_size: 128 does not divide "
                                         r"layers.0.self_attn.q_proj's in_features 64"):
        from_pretrained(folder, quantize="int4", group_size=128)


@pytest.mark.parametrize(("bits", "group_size"), [(8, 64), (4, 64), (4, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_quantized_a_block_of_rows_at_a_time_has_the_whole_weights_codes(
        bits, group_size, dtype) -> None:
    """The modules quantize large weights by blocks of rows (small float temporaries); every
    scale is a row's or a row group's, so the codes are those of the formula on the whole."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(2048, 1100, dtype=dtype)  # blocks of 512 rows: 512, 512, 76
    whole = quantize(linear.weight, bits, group_size if bits == 4 else None, dtype)
    table = QuantizedEmbedding.from_embedding(torch.nn.Embedding(1100, 2048, _weight=linear.weight),
                                              bits=bits, group_size=group_size).table
    for module in (QuantizedLinear.from_linear(linear, bits=bits, group_size=group_size), table):
        got = module.weight_format.with_layout("plain")
        assert torch.equal(got.data, whole.data) and torch.equal(got.scales, whole.scales)
        assert (got.zeros is None and whole.zeros is None) or torch.equal(got.zeros, whole.zeros)
