"""`attnlab generate` with OpenAI's controls: --json-schema, --logit-bias, --presence-penalty,
--frequency-penalty, --min-p (flags and generation_config.json)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from attnlab.cli import main
from attnlab.generation import generate
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.models.io import from_pretrained, save_pretrained
from attnlab.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 1, "maximum": 9}}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("controls-folder")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        [json.dumps({"color": c, "size": i}) for i, c in enumerate(["red", "blue"] * 9)],
        trainers.BpeTrainer(vocab_size=320, special_tokens=["<|end|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    torch.manual_seed(0)
    config = DecoderLMConfig.llama(backend.get_vocab_size(), d_model=32, num_layers=2,
                                   num_heads=4, max_len=64)
    save_pretrained(DecoderLM(config), path)
    return path


def _run(folder, *flags: str) -> list[str]:
    return ["generate", "--model", str(folder), "--prompt", "json:", *flags]


def test_json_schema_output_validates(folder, tmp_path, capsys) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(_run(folder, "--json-schema", str(schema), "--max-new-tokens", "40")) == 0
    captured = capsys.readouterr()
    jsonschema.validate(json.loads(captured.out), SCHEMA)
    assert "incomplete" not in captured.err


def test_json_schema_cut_by_the_limit_says_so(folder, tmp_path, capsys) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(_run(folder, "--json-schema", str(schema), "--max-new-tokens", "2")) == 0
    assert "the JSON is incomplete" in capsys.readouterr().err


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "array", "uniqueItems": True}, 'cannot enforce the JSON Schema keywords '
                                             '["uniqueItems"]'),
    ("{", "schema.json: Expecting property name"),
])
def test_json_schema_refusals_name_the_flag_and_keyword(folder, tmp_path, capsys, schema,
                                                        message: str) -> None:
    path = tmp_path / "schema.json"
    path.write_text(schema if isinstance(schema, str) else json.dumps(schema))
    assert main(_run(folder, "--json-schema", str(path), "--max-new-tokens", "4")) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnlab: error: --json-schema: ") and message in err


def test_logit_bias_and_penalties_reach_generate(folder, capsys) -> None:
    tok, model = Tokenizer.from_pretrained(folder), from_pretrained(folder)
    prompt = torch.tensor([tok.encode("json:")])
    flags = ("--max-new-tokens", "6", "--logit-bias", "40=5", "--logit-bias", "41=-100",
             "--presence-penalty", "1.5", "--frequency-penalty", "-0.5")
    assert main(_run(folder, *flags)) == 0
    ids = generate(model, prompt, 6, eos_token_id=tok.eos_token_id,
                   logit_bias={40: 5.0, 41: -100.0}, presence_penalty=1.5,
                   frequency_penalty=-0.5)
    new = ids[0, prompt.shape[1]:].tolist()
    assert capsys.readouterr().out == tok.decode(new, skip_special_tokens=True) + "\n"
    assert 41 not in new


@pytest.mark.parametrize(("flags", "message"), [
    (("--presence-penalty", "2.5"), "--presence-penalty: expected a number in [-2, 2]"),
    (("--frequency-penalty", "-3"), "--frequency-penalty: expected a number in [-2, 2]"),
    (("--logit-bias", "4=101"), "--logit-bias: expected ID=B, a token id and a bias in "
                                "[-100, 100]"),
    (("--min-p", "1.5"), "--min-p: expected a number in [0, 1]"),
])
def test_out_of_range_flags_are_refused(folder, capsys, flags, message: str) -> None:
    with pytest.raises(SystemExit):
        main(_run(folder, *flags))
    assert message in capsys.readouterr().err


def test_logit_bias_outside_the_vocabulary(folder, capsys) -> None:
    assert main(_run(folder, "--logit-bias", "99999=1")) == 2
    assert "--logit-bias: expected token ids in [0, " in capsys.readouterr().err


def test_min_p_from_generation_config(folder, tmp_path, capsys) -> None:
    """min_p = 1 keeps only the most likely token: sampling then prints the greedy text."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    (copy / "generation_config.json").write_text(json.dumps({"min_p": 1.0, "do_sample": True}))
    assert main(_run(copy, "--max-new-tokens", "6", "--seed", "3")) == 0
    sampled = capsys.readouterr().out
    assert main(_run(folder, "--max-new-tokens", "6")) == 0
    assert sampled == capsys.readouterr().out
    (copy / "generation_config.json").write_text(json.dumps({"min_p": 2}))
    assert main(_run(copy, "--max-new-tokens", "2")) == 2
    assert "min_p: expected a number in [0, 1], got 2" in capsys.readouterr().err
