"""The tiny checkpoint folders that tests across the tree read (a trained byte-level BPE
tokenizer with a chat template, and a two-layer Qwen2 written by our ``save_pretrained``); at the
top of ``tests/`` because the CLI, quantization, serving and generation tests all use them."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from attnlab.models.decoder import DecoderLM
from attnlab.models.families import FAMILIES
from attnlab.models.io import save_pretrained

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_folder(folder) -> None:
    """A Qwen2 folder written by our ``save_pretrained``, with a tokenizer."""
    vocab = make_tokenizer(folder)
    config = FAMILIES["qwen2"].config_from_hf(
        {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "initializer_range": 0.2})
    torch.manual_seed(0)
    save_pretrained(DecoderLM(config), folder)


def make_tokenizer(folder) -> int:
    """A byte-level BPE tokenizer of 300 tokens with a chat template; returns its size."""
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
    return tok.get_vocab_size()
