"""`attnlab generate` on a tiny checkpoint folder (our weights + a trained BPE tokenizer)."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from attnlab.cli import main
from attnlab.generation import generate
from attnlab.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from attnlab.tokenizer import Tokenizer

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_folder(folder) -> None:
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["once upon a time there was a fox", "the fox said hello to the world"],
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    config = Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)


def test_generate_streams_text_and_reports_speed(tmp_path, capsys) -> None:
    make_folder(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "once upon a",
                 "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    tok = Tokenizer.from_pretrained(tmp_path)
    model = Qwen2ForCausalLM.from_pretrained(tmp_path)
    prompt = tok.encode("once upon a")
    ids = generate(model, torch.tensor([prompt]), 12, eos_token_id=tok.eos_token_id)
    expected = tok.decode(ids[0, len(prompt):], skip_special_tokens=True)
    assert captured.out == expected + "\n"
    assert f"{len(prompt)} prompt tokens" in captured.err and "tokens/s" in captured.err


def test_generate_chat_and_sampling(tmp_path, capsys) -> None:
    make_folder(tmp_path)
    args = ["generate", "--model", str(tmp_path), "--prompt", "hello fox", "--chat",
            "--system", "be brief", "--max-new-tokens", "6", "--do-sample", "--top-k", "5",
            "--temperature", "0.8", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr()
    tok = Tokenizer.from_pretrained(tmp_path)
    chat = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hello fox"}],
                                   add_generation_prompt=True, tokenize=True)
    assert f"{len(chat)} prompt tokens" in first.err
    assert main(args) == 0
    assert capsys.readouterr().out == first.out  # same seed, same text


def test_generate_errors(tmp_path, capsys) -> None:
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
