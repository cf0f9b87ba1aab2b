"""Quantized checkpoint folders: ``attnlab quantize`` and ``from_pretrained(quantize=)`` on a
family folder, the record in ``config.json``, reloading without re-quantizing, generation
through the CLI, and hostile or mismatching folders refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_quantized_modules import _dequantized_copy

from attnlab.cli import main
from attnlab.generation import generate
from attnlab.models.decoder import DecoderLM
from attnlab.models.io import from_pretrained
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.quantization import QuantizedEmbedding, QuantizedLinear, weight_bytes
from attnlab.quantization import kernels as qkernels
from attnlab.quantization.convert import DEFAULT_INT8_LAYERS
from attnlab.tokenizer import Tokenizer
from tiny_folders import make_folder


@pytest.fixture(scope="module")
def family_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    make_folder(folder)
    return folder


@pytest.mark.parametrize(("bits", "group_size", "method"), [(8, None, "int8"), (4, 32, "int4")])
def test_cli_quantize_writes_a_folder_that_loads_and_generates(
        family_folder, tmp_path, capsys, monkeypatch, bits: int, group_size: int | None,
        method: str) -> None:
    out = tmp_path / "q"
    argv = ["quantize", str(family_folder), str(out), "--bits", str(bits)]
    with monkeypatch.context() as patch:  # writing the codes times no kernel
        patch.delenv("ATTNLAB_KERNELS", raising=False)  # conftest forces one
        patch.setattr(qkernels, "_time_kernels",
                      lambda *args, **kwargs: pytest.fail("quantize timed a kernel"))
        assert main(argv + (["--group-size", str(group_size)] if group_size else [])) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and f"as {method}" in printed
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "attnlab_decoder" and config["family"] == "qwen2"
    written = dict(config["quantization"])
    wide = written.pop("int8_layers", [])
    assert written == {"method": method, "group_size": group_size, "skip": [], "table_bits": 8,
                       "fit": "search" if bits == 4 else "nearest",
                       **({"scale_dtype": "int8"} if bits == 4 else {})}
    # int4: the default int8 layers, then the outlier down_proj chosen, by name
    assert wide == ([] if bits == 8 else [*DEFAULT_INT8_LAYERS, wide[-1]])
    assert bits == 8 or re.fullmatch(r"layers\.\d+\.mlp\.down_proj", wide[-1])
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()

    model = from_pretrained(out)
    assert model.quantization.method == method
    assert isinstance(model.lm_head, QuantizedLinear)
    assert isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)
    # the folder holds exactly what quantizing the float folder gives: no re-quantizing
    direct = from_pretrained(family_folder, quantize=method, group_size=group_size)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), direct(ids), rtol=0, atol=0)
        # and equals the float model holding the dequantized weights
        reference = _dequantized_copy(model, from_pretrained(family_folder, kernels=False))
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)
    assert weight_bytes(model) < (0.35 if bits == 8 else 0.25) * weight_bytes(reference)

    assert main(["generate", "--model", str(out), "--prompt", "once upon a",
                 "--max-new-tokens", "8"]) == 0
    text = capsys.readouterr().out
    tok = Tokenizer.from_pretrained(out)
    prompt = tok.encode("once upon a")
    new = generate(model, torch.tensor([prompt]), 8, eos_token_id=tok.eos_token_id)
    assert text == tok.decode(new[0, len(prompt):], skip_special_tokens=True) + "\n"

    html = tmp_path / "viz.html"
    assert main(["viz", "--checkpoint", str(out), "--text", "once upon a time",
                 "--html", str(html)]) == 0
    assert html.is_file() and "once" in html.read_text()


def test_a_quantized_folder_refuses_another_scheme(family_folder, tmp_path) -> None:
    out = tmp_path / "q"
    from_pretrained(family_folder, quantize="int4", group_size=32).save_pretrained(out)
    assert from_pretrained(out, quantize="int4", group_size=32).quantization.group_size == 32
    with pytest.raises(ValueError, match=r"quantize: .* holds int4 \(group_size 32, search, "
                                         r"tables int8\) weights, but int8 was asked"):
        from_pretrained(out, quantize="int8")
    with pytest.raises(ValueError, match=r"but int4 \(group_size 64, search, tables int8\) was "
                                         r"asked"):
        from_pretrained(out, quantize="int4", group_size=64)


def test_skip_is_recorded_and_kept_float(family_folder, tmp_path) -> None:
    out = tmp_path / "q"
    assert main(["quantize", str(family_folder), str(out), "--skip", "lm_head"]) == 0
    model = from_pretrained(out)
    assert type(model.lm_head) is not QuantizedLinear
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert model.quantization.skip == ("lm_head",)


@pytest.mark.parametrize(("record", "match"), [
    ({"method": "int4", "group_size": 48, "skip": []}, "group_size: expected one of"),
    ({"method": "int2"}, "quantize: expected one of int8, int4"),
    ({"method": "int8", "bits": 8}, "quantization: expected the keys"),
    ("int8", "quantization: expected an object"),
])
def test_hostile_quantization_records_name_the_file(family_folder, tmp_path, record,
                                                    match: str) -> None:
    out = tmp_path / "q"
    from_pretrained(family_folder, quantize="int8").save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["quantization"] = record
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises((TypeError, ValueError), match=match) as error:
        from_pretrained(out)
    assert "config.json" in str(error.value)


def test_a_record_that_does_not_match_the_tensors_is_refused(family_folder, tmp_path) -> None:
    out = tmp_path / "q"
    from_pretrained(family_folder, quantize="int4", group_size=32).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["quantization"] = {"method": "int8", "group_size": None, "skip": []}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"does not match the weights.*qweight: .* in the file"):
        from_pretrained(out)


def test_cli_quantize_errors(family_folder, tmp_path, capsys) -> None:
    assert main(["quantize", str(family_folder), str(tmp_path / "a"), "--bits", "8",
                 "--group-size", "64"]) == 2
    assert "--group-size: int8 scales whole rows" in capsys.readouterr().err
    assert main(["quantize", str(family_folder), str(family_folder)]) == 2
    assert "is FOLDER itself" in capsys.readouterr().err
    assert main(["quantize", str(family_folder), str(tmp_path / "b"), "--bits", "4",
                 "--group-size", "48"]) == 2
    assert "group_size: expected one of 32, 64, 128, 256" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_the_seq2seq_transformer_quantizes_and_round_trips(tmp_path) -> None:
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(40, 40, d_model=64, num_heads=4, num_encoder_layers=1,
                                          num_decoder_layers=1, d_ff=128, dropout=0.0)).eval()
    model.quantize("int4", 32)
    src, tgt = torch.randint(1, 40, (2, 6)), torch.randint(1, 40, (2, 5))
    with torch.inference_mode():
        expected = model(src, tgt)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    assert isinstance(loaded, Transformer) and loaded.quantization == model.quantization
    with torch.inference_mode():
        torch.testing.assert_close(loaded(src, tgt), expected, rtol=0, atol=0)


def test_decoder_make_cache_follows_the_activation_dtype() -> None:
    from attnlab.models.decoder_config import DecoderLMConfig
    model = DecoderLM(DecoderLMConfig(vocab_size=64, d_model=64, num_heads=4, num_layers=1,
                                      d_ff=64, max_len=32)).to(torch.bfloat16)
    model.quantize("int8")
    assert model.dtype == torch.bfloat16 and model.make_cache(1)[0].k.dtype == torch.bfloat16
