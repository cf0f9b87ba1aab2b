"""``attnlab viz`` on tiny checkpoints made by the test: seq2seq, char LM and Qwen2 folder."""

from __future__ import annotations

import pytest
import torch

from attnlab.cli import main
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
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
    assert names == ["cross_entropy.png", "cross_layer0.png", "cross_layer1.png",
                     "cross_similarity.png", "decoder_entropy.png", "decoder_layer0.png",
                     "decoder_layer1.png", "decoder_similarity.png", "encoder_entropy.png",
                     "encoder_layer0.png", "encoder_similarity.png"]


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


def test_viz_qwen2_folder(tmp_path, capsys):
    qwen2 = pytest.importorskip("attnlab.models.qwen2")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "the", "cat", "sat", "on", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    config = qwen2.Qwen2Config(vocab_size=16, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=32)
    folder = qwen2.Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen")
    tok.save(str(folder / "tokenizer.json"))
    html = tmp_path / "q.html"
    assert main(["viz", "--checkpoint", str(folder), "--text", "the cat sat on the mat",
                 "--html", str(html)]) == 0
    assert "| self | 1 | 3 |" in capsys.readouterr().out
    assert '"queries":["the","cat","sat","on","the","mat"]' in html.read_text()
