"""``attnlab generate --model FILE.gguf`` and the server's loader on a GGUF file: the option
takes a file, and the text is the library's greedy text."""

from __future__ import annotations

import json

import torch
from fastapi.testclient import TestClient
from gguf_writing import Q, bpe_vocabulary, tiny_model, write_gguf

from attnlab.cli import main
from attnlab.generation import generate
from attnlab.models import from_pretrained
from attnlab.serving.server import create_app
from attnlab.tokenizer import Tokenizer


def _file(tmp_path):
    tokens, merges = bpe_vocabulary()
    return write_gguf(tmp_path / "tiny.gguf", tiny_model("qwen2", len(tokens)), "qwen2",
                      Q.Q4_0, tokens=tokens, merges=merges)


def test_generate_takes_a_gguf_file(tmp_path, capsys):
    file = _file(tmp_path)
    assert main(["generate", "--model", str(file), "--prompt", "The quick", "--chat",
                 "--max-new-tokens", "6"]) == 0
    tok = Tokenizer.from_pretrained(file)
    prompt = tok.apply_chat_template([{"role": "user", "content": "The quick"}],
                                     add_generation_prompt=True, tokenize=True)
    ids = generate(from_pretrained(file), torch.tensor([prompt]), 6,
                   eos_token_id=tok.eos_token_id)
    expected = tok.decode(ids[0, len(prompt):], skip_special_tokens=True)
    assert capsys.readouterr().out == expected + "\n"


def test_the_server_loads_a_gguf_file(tmp_path):
    with TestClient(create_app(str(_file(tmp_path)))) as client:
        reply = client.post("/v1/completions", json={"model": "tiny.gguf", "prompt": "The",
                                                      "max_tokens": 3, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 3


def test_viz_takes_a_gguf_file(tmp_path, capsys):
    file = _file(tmp_path)
    html = tmp_path / "view.html"
    assert main(["viz", "--model", str(file), "--text", "The quick brown fox",
                 "--html", str(html)]) == 0
    assert f"wrote {html}" in capsys.readouterr().out
    tokens = [Tokenizer.from_pretrained(file).decode([i])
              for i in Tokenizer.from_pretrained(file).encode("The quick brown fox")]
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") and all(json.dumps(t) in page for t in tokens)
