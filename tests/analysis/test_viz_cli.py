"""``attnlab viz`` on tiny checkpoints made by the test: seq2seq, char LM and a Hugging Face
folder of every supported family."""

from __future__ import annotations

import json
import re

import pytest
import torch
from tiny_families import tiny_hf_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM

import attnlab.cli.viz
from attnlab.analysis import capture
from attnlab.analysis.viewer_page import script_json
from attnlab.cli import build_parser, main
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.families import FAMILIES
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.training.checkpoint import save_checkpoint
from attnlab.training.tasks.seq2seq import make_seq2seq_task


def _seq2seq_checkpoint(path):
    task = make_seq2seq_task("copy", max_len=6, n_test=4, n_valid=4)
    torch.manual_seed(0)
    config = TransformerConfig(src_vocab_size=len(task.src_vocab),
                               tgt_vocab_size=len(task.tgt_vocab), d_model=16, num_heads=2,
                               num_encoder_layers=1, num_decoder_layers=2, d_ff=32,
                               dropout=0.0, max_len=32)
    extra = {"task": "copy", "seed": 0, "max_len": 6, "src_chars": task.src_vocab.chars,
             "tgt_chars": task.tgt_vocab.chars}
    return save_checkpoint(path, Transformer(config), model_type="transformer",
                           model_config=config.to_dict(), extra=extra)


def test_viz_seq2seq_html_and_pngs(tmp_path, capsys):
    ckpt = _seq2seq_checkpoint(tmp_path / "ckpt")
    html, png = tmp_path / "view.html", tmp_path / "png"
    assert main(["viz", "--checkpoint", str(ckpt), "--text", "31415", "--html", str(html),
                 "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| cross | 1 | 1 |" in out and f"wrote {html}" in out
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and '"cross-attention"' in page
    assert "<script src" not in page and "<link" not in page
    names = sorted(p.name for p in png.iterdir())
    # The head similarity of every layer, as --help says (two decoder layers here).
    assert names == ["cross_entropy.png", "cross_layer0.png", "cross_layer1.png",
                     "cross_similarity_layer0.png", "cross_similarity_layer1.png",
                     "decoder_entropy.png", "decoder_layer0.png", "decoder_layer1.png",
                     "decoder_similarity_layer0.png", "decoder_similarity_layer1.png",
                     "encoder_entropy.png", "encoder_layer0.png", "encoder_similarity_layer0.png"]


def test_viz_char_lm_and_errors(tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    config = DecoderLMConfig.gpt(4 + 5, d_model=16, num_layers=1, num_heads=2, max_len=32)
    ckpt = save_checkpoint(tmp_path / "lm", DecoderLM(config), model_type="decoder_lm",
                           model_config=config.to_dict(), extra={"task": "lm", "chars": "abcde"})
    monkeypatch.chdir(tmp_path)
    assert main(["viz", "--checkpoint", str(ckpt), "--text", "abcab", "--heads", "1"]) == 0
    assert (tmp_path / "attention.html").is_file()
    assert "| self | 0 | 1 |" in capsys.readouterr().out
    assert main(["viz", "--checkpoint", str(tmp_path / "nope"), "--text", "a"]) == 2
    assert "checkpoint: no config.json" in capsys.readouterr().err
    assert main(["viz", "--checkpoint", str(ckpt), "--text", "ab", "--layers", "3"]) == 2
    assert "layers: self-attention has layers [0], got [3]" in capsys.readouterr().err


def _hf_folder(path, model_type="qwen2", vocab_size=16):
    """A tiny random transformers checkpoint of ``model_type`` with a word-level tokenizer;
    returns ``(folder, the transformers model)``."""
    words = ["<unk>", "the", "cat", "sat", "on", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    config = tiny_hf_config(model_type, vocab_size)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path, model


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_viz_hf_folder_of_every_family(tmp_path, capsys, model_type):
    folder, hf = _hf_folder(tmp_path / model_type, model_type)
    html = tmp_path / "q.html"
    text = "the cat sat on the mat"
    assert main(["viz", "--checkpoint", str(folder), "--text", text, "--html", str(html)]) == 0
    assert "| self | 1 | 3 |" in capsys.readouterr().out
    assert '"queries":["the","cat","sat","on","the","mat"]' in html.read_text()
    # the weights drawn are transformers' own attention weights
    model, ids, tokens, _ = attnlab.cli.viz.load_for_viz(folder, text)
    maps = capture(model, ids, tokens=tokens["input"])["self"]
    with torch.no_grad():
        expected = torch.stack(hf(ids, output_attentions=True).attentions, dim=1)
    torch.testing.assert_close(maps.weights, expected, rtol=1e-5, atol=1e-5)


def test_viz_refuses_unsupported_and_mismatched_folders(tmp_path, capsys):
    folder, _ = _hf_folder(tmp_path / "qwen")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    assert main(["viz", "--checkpoint", str(folder), "--text", "the cat"]) == 2
    err = capsys.readouterr().err
    assert "model_type 'bert'; expected one of [" in err and "'qwen2'" in err
    (folder / "config.json").write_text("{not json")
    assert main(["viz", "--checkpoint", str(folder), "--text", "the cat"]) == 2
    assert "config.json: not valid JSON" in capsys.readouterr().err
    folder, _ = _hf_folder(tmp_path / "qwen2")
    assert main(["viz", "--checkpoint", str(folder), "--text", "cat " * 65]) == 2
    assert "text: expected at most 64 tokens (the model's max_len), got 65" in \
        capsys.readouterr().err
    small, _ = _hf_folder(tmp_path / "small", vocab_size=4)  # the tokenizer has 6 words
    assert main(["viz", "--checkpoint", str(small), "--text", "the cat on the mat"]) == 2
    assert ("tokenizer.json gives ids [4, 5] for the text, outside the model's vocabulary "
            "of 4") in capsys.readouterr().err
    (small / "tokenizer.json").write_text("{}")
    assert main(["viz", "--checkpoint", str(small), "--text", "the cat"]) == 2
    assert "tokenizer.json: not a readable tokenizers file" in capsys.readouterr().err


def _char_lm(path, chars):
    torch.manual_seed(0)
    config = DecoderLMConfig.gpt(4 + len(chars), d_model=16, num_layers=1, num_heads=2,
                                 max_len=48)
    return save_checkpoint(path, DecoderLM(config), model_type="decoder_lm",
                           model_config=config.to_dict(), extra={"task": "lm", "chars": chars})


def test_viz_alignment_refuses_other_checkpoints_before_any_work(tmp_path, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("viz captured attention before refusing --alignment")

    monkeypatch.setattr(attnlab.cli.viz, "load_for_viz", no_work)
    monkeypatch.chdir(tmp_path)
    copy = _seq2seq_checkpoint(tmp_path / "copy")
    assert main(["viz", "--checkpoint", str(copy), "--text", "123", "--alignment"]) == 2
    err = capsys.readouterr().err
    assert "--alignment: needs a date-task checkpoint" in err
    assert "got model_type 'transformer' with task 'copy'" in err
    qwen, _ = _hf_folder(tmp_path / "qwen")
    assert main(["viz", "--checkpoint", str(qwen), "--text", "the cat", "--alignment"]) == 2
    err = capsys.readouterr().err
    assert "--alignment: needs a date-task checkpoint" in err and "not an attnlab" in err
    assert not (tmp_path / "attention.html").exists()


def test_viz_refuses_bad_text_and_options_clearly(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = _char_lm(tmp_path / "lm", "abcde")
    cases = [
        (["--text", ""], "--text: expected a non-empty string, got ''"),
        (["--text", "abxzy"], "text: characters 'xyz' are not in the checkpoint's vocabulary"),
        (["--text", "a" * 49], "text: expected at most 48 characters (the model's max_len)"),
        (["--text", "ab", "--max-tokens", "0"], "--max-tokens: expected a positive int, got 0"),
        (["--text", "ab", "--max-lines", "-1"], "--max-lines: expected a positive int, got -1"),
        (["--text", "ab", "--html", str(tmp_path)], "--html: " + repr(str(tmp_path)) +
         " is a folder, expected a file name"),
        (["--text", "ab", "--html", "f/v.html"], "--html: 'f' is a file, expected a folder"),
        (["--text", "ab", "--png", "f/png"], "--png: 'f' is a file, expected a folder there"),
    ]
    (tmp_path / "f").write_text("")
    for args, message in cases:
        assert main(["viz", "--checkpoint", str(ckpt), *args]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "attention.html").exists()


def test_viz_help_describes_every_option():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    viz = sub.choices["viz"]
    options = [a for a in viz._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in options} >= {"model", "text", "html", "png", "layers",
                                         "heads", "max_tokens", "max_lines", "alignment"}
    assert all(a.help and len(a.help) > 20 for a in options)
    text = " ".join(viz.format_help().split())  # undo the line wrapping
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("(default: 256)") == 1 and "default 256" not in text


def test_viz_hostile_text_reaches_the_page_as_text(tmp_path, capsys):
    text = "__DATA__<img src=x onerror=alert(1)>"
    ckpt = _char_lm(tmp_path / "lm", "".join(sorted(set(text))))
    html = tmp_path / "odd dir ü #?$ '\"" / "v.html"  # a path with odd characters too
    assert main(["viz", "--checkpoint", str(ckpt), "--text", text, "--html", str(html)]) == 0
    page = html.read_text()
    assert page.count("<img") == 0 and page.count("<script") == 2
    title = f"lm: {text!r}".replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert f"<h1>{title.replace(chr(39), '&#x27;')}</h1>" in page
    data = re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)
    assert json.loads(data[1])["kinds"][0]["queries"] == list(text)
    assert script_json(json.loads(data[1])) == data[1]
