"""`attnlab generate --speculative`: the same text as without it, the drafts counted on
stderr, bad choices refused naming the flag."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from attnlab.cli import main
from attnlab.models.decoder import DecoderLM
from attnlab.models.families import FAMILIES
from attnlab.models.io import save_pretrained
from tiny_folders import make_folder, make_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    make_folder(folder)
    return folder


def run(folder, capsys, *flags: str) -> tuple[int, str, str]:
    try:
        code = main(["generate", "--model", str(folder), "--prompt", "the fox said the fox",
                     "--max-new-tokens", "24", *flags])
    except SystemExit as exit_:  # argparse refuses a bad flag value this way
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("choice", ["ngram", "ngram:3", "self:1", "draft"])
@pytest.mark.parametrize("sampling", [[], ["--repetition-penalty", "1.3", "--stop", "fox"]])
def test_speculative_text_equals_plain_text(folder, tmp_path, capsys, choice, sampling) -> None:
    if choice == "draft":  # a 1-layer model with the same tokenizer
        draft = tmp_path / "draft"
        draft.mkdir()
        vocab = make_tokenizer(draft)
        config = FAMILIES["qwen2"].config_from_hf(
            {"vocab_size": vocab, "hidden_size": 16, "intermediate_size": 32,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
             "max_position_embeddings": 256})
        torch.manual_seed(5)
        save_pretrained(DecoderLM(config), draft)
        choice = f"draft:{draft}"
    code, plain, _ = run(folder, capsys, *sampling)
    assert code == 0
    code, out, err = run(folder, capsys, *sampling, "--speculative", choice)
    assert code == 0, err
    assert out == plain
    assert f"speculative {choice.split(':')[0]}: " in err and "tokens per pass" in err


@pytest.mark.parametrize(("choice", "message"), [
    ("ngram:0", r"--speculative: expected ngram:K with an int K >= 1, got 'ngram:0'"),
    ("self", r"--speculative: expected self:N with an int N >= 1, got 'self'"),
    ("medusa", r"--speculative: expected ngram, ngram:K, self:N or draft:DIR, got 'medusa'"),
    ("self:2", r"--speculative self:2: expected fewer layers than the model's 2"),
    ("draft:/nonexistent/x", r"--speculative draft:/nonexistent/x: "),
])
def test_bad_choices_are_refused_naming_the_flag(folder, capsys, choice, message) -> None:
    code, out, err = run(folder, capsys, "--speculative", choice)
    assert code == 2 and out == ""
    assert re.search(message, err), err


def test_a_draft_with_another_vocabulary_is_refused(folder, tmp_path, capsys) -> None:
    other = shutil.copytree(folder, tmp_path / "other")
    config = FAMILIES["qwen2"].config_from_hf(
        {"vocab_size": 17, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256})
    save_pretrained(DecoderLM(config), other)
    code, _, err = run(folder, capsys, "--speculative", f"draft:{other}")
    assert code == 2 and "assistant_model: expected the target's vocabulary" in err
