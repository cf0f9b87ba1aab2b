"""``attnlab quantize``'s int4 choices: --method (search by default, nearest, gptq with
--calibration) and --table-bits parse, are recorded in config.json, and a misuse is refused
naming the option; ``attnlab eval perplexity`` reports against a reference."""

from __future__ import annotations

import fnmatch
import json

import pytest

from attnlab.cli import main
from attnlab.models.io import from_pretrained
from attnlab.quantization import QuantizedLinear
from attnlab.quantization.convert import last_layer
from tiny_folders import make_folder

TEXT = "once upon a time there was a fox. the fox said hello to the world. " * 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("float")
    make_folder(folder)
    return folder


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


@pytest.mark.parametrize(("options", "record"), [
    (["--group-size", "32"], {"fit": "search", "table_bits": 8, "group_size": 32}),
    (["--method", "nearest", "--group-size", "32"], {"fit": "nearest", "table_bits": 8}),
    (["--table-bits", "4", "--group-size", "32"], {"fit": "search", "table_bits": 4}),
    (["--int8-layers", "*.k_proj", "--group-size", "32"], {"int8_layers": ["*.k_proj"]}),
])
def test_int4_options_are_recorded(folder, tmp_path, options, record):
    out = tmp_path / "q"
    assert main(["quantize", str(folder), str(out), "--bits", "4", *options]) == 0
    written = json.loads((out / "config.json").read_text())["quantization"]
    assert written.items() >= record.items()
    model = from_pretrained(out, kernels=False)
    table = model.embed_tokens.source
    last = str(last_layer(model))
    wide = tuple(p.replace("{last}", last) for p in written.get("int8_layers", ()))
    bits = {name: m.bits for name, m in model.named_modules()
            if isinstance(m, QuantizedLinear) and m not in (model.lm_head, table)}
    assert bits == {name: 8 if any(fnmatch.fnmatchcase(name, p) for p in wide) else 4
                    for name in bits} and 4 in bits.values()
    assert table.bits == written["table_bits"]
    assert model.quantization.to_dict() == written


def test_gptq_with_calibration_writes_a_folder_that_loads(folder, text, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(folder), str(out), "--bits", "4", "--method", "gptq",
                 "--calibration", str(text), "--group-size", "32"]) == 0
    assert "gptq" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["quantization"]["fit"] == "gptq"
    assert from_pretrained(out).quantization.fit == "gptq"


@pytest.mark.parametrize(("options", "message"), [
    (["--bits", "4", "--method", "gptq"], "--calibration: --method gptq needs a text file"),
    (["--bits", "4", "--calibration", "TEXT"], "--calibration: only --method gptq reads "
     "calibration text, got --method search (the default)"),
    (["--bits", "8", "--method", "search"], "--method: int8 scales whole rows"),
    (["--bits", "8", "--table-bits", "4"], "--table-bits: int8 scales whole rows"),
    (["--bits", "8", "--int8-outliers", "2"], "--int8-outliers: int8 scales whole rows"),
])
def test_misuse_is_refused_naming_the_option(folder, text, tmp_path, capsys, options,
                                             message):
    options = [str(text) if o == "TEXT" else o for o in options]
    assert main(["quantize", str(folder), str(tmp_path / "q"), *options]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_an_unknown_method_is_refused_by_argparse(folder, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["quantize", str(folder), str(tmp_path / "q"), "--bits", "4", "--method", "best"])
    assert "argument --method: invalid choice: 'best'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantize", str(folder), str(tmp_path / "q"), "--bits", "4", "--int8-outliers",
              "-1"])
    assert "argument --int8-outliers: expected an int >= 0, got '-1'" in capsys.readouterr().err


def test_int8_outliers_from_the_command_line_are_chosen_and_recorded(folder, tmp_path):
    out = tmp_path / "q"
    assert main(["quantize", str(folder), str(out), "--bits", "4", "--group-size", "32",
                 "--int8-layers", "*.v_proj", "--int8-outliers", "1"]) == 0
    written = json.loads((out / "config.json").read_text())["quantization"]
    assert written["int8_layers"][0] == "*.v_proj" and len(written["int8_layers"]) == 2
    assert fnmatch.fnmatchcase(written["int8_layers"][1], "layers.*.mlp.down_proj")
    assert from_pretrained(out, kernels=False).get_submodule(written["int8_layers"][1]).bits == 8


def test_eval_perplexity_against_a_reference(folder, text, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(folder), str(out), "--bits", "4", "--group-size", "32"]) == 0
    capsys.readouterr()
    assert main(["eval", "perplexity", "--model", str(out), "--reference", str(folder),
                 "--text", str(text), "--context", "64", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    for line in ("chunks of 64", "perplexity: ", "reference perplexity: ",
                 "KL(reference || model): mean ", "99th percentile", "top-1 agreement: "):
        assert line in printed
    assert main(["eval", "perplexity", "--model", str(folder), "--text", str(text),
                 "--context", "63"]) == 2
    assert "--context: expected an even number of tokens >= 4, got 63" in \
        capsys.readouterr().err


