"""Tokenizer: a ``tokenizers`` BPE trained here, against transformers' fast tokenizer."""

from __future__ import annotations

import json
import threading
import time
import types

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from attnlab.tokenizer import TextStreamer, Tokenizer

# A Qwen-style ChatML template with a default system message, loops, conditionals and tojson.
TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are kind.<|im_end|>"
    "\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if tools %}{{ tools | tojson }}{% endif %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
LINES = ["hello world, this is a test of the tokenizer", "the quick brown fox jumps over",
         "héllo wörld, ünïcode and 你好 世界", "chat templates render messages"]
MESSAGES = [{"role": "user", "content": "hi there, 你好"},
            {"role": "assistant", "content": "hello!"},
            {"role": "user", "content": "the fox?"}]


def make_tokenizer(folder, *, inline_template: bool = True) -> None:
    """Train a byte-level BPE on a few lines; write tokenizer.json + tokenizer_config.json."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel
                                  .alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(LINES, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if inline_template:
        config["chat_template"] = TEMPLATE
    else:
        (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("inline", [True, False])
def test_matches_transformers(tmp_path, inline) -> None:
    transformers = pytest.importorskip("transformers")
    make_tokenizer(tmp_path, inline_template=inline)
    ours = Tokenizer.from_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (ours.eos_token, ours.pad_token, ours.bos_token) == ("<|im_end|>", "<|endoftext|>",
                                                                None)
    assert ours.eos_token_id == hf.eos_token_id and ours.pad_token_id == hf.pad_token_id
    for text in [*LINES, "unseen wörds 🙂 here"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids) == text == hf.decode(ids)
    for gen in (False, True):
        text = ours.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(MESSAGES, add_generation_prompt=gen,
                                              tokenize=False)
        ids = ours.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=True)
        assert ids == hf.apply_chat_template(MESSAGES, add_generation_prompt=gen,
                                             tokenize=True, return_dict=False)
    tools = [{"name": "wetter", "description": "Grüße"}]
    assert ours.apply_chat_template(MESSAGES, tools=tools) == hf.apply_chat_template(
        MESSAGES, tools=tools, tokenize=False)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True).endswith(
        "<|im_end|>\n<|im_start|>assistant\n")


def test_batch_encode_pads_left(tmp_path) -> None:
    make_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["pad_token"] = {"content": "<|endoftext|>", "special": True}  # older files' form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(tmp_path)
    ids, mask = tok.batch_encode(["the quick brown fox", "hi"])
    short = tok.encode("hi")
    assert ids.shape == mask.shape and ids.shape[0] == 2
    assert ids[1, -len(short):].tolist() == short
    assert mask[1].tolist() == [0] * (ids.shape[1] - len(short)) + [1] * len(short)
    assert set(ids[1, : ids.shape[1] - len(short)].tolist()) == {tok.pad_token_id}


def test_streamer_writes_whole_characters(tmp_path) -> None:
    make_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    text = "héllo 你好 world<|im_end|>"
    pieces: list[str] = []
    streamer = TextStreamer(tok, pieces.append)
    for i in tok.encode(text):
        streamer.put(torch.tensor([i]))
    streamer.end()
    assert "".join(pieces) == "héllo 你好 world" == streamer.text  # special token skipped
    assert all("\ufffd" not in p for p in pieces) and len(pieces) > 3


def test_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json: no such file"):
        Tokenizer.from_pretrained(tmp_path)
    make_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**config, "eos_token": "<eos>", "chat_template": None}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: special_tokens: eos_token "
                       r"'<eos>' is not in the vocabulary"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="chat_template: this tokenizer has none"):
        tok.apply_chat_template(MESSAGES)
    with pytest.raises(TypeError, match="text: expected a str"):
        tok.encode(3)


def write_config(folder, **changes) -> None:
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_named_chat_templates_pick_default_as_transformers(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    make_tokenizer(tmp_path)
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "TOOLS"},
                                          {"name": "default", "template": TEMPLATE}])
    ours = Tokenizer.from_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.chat_template == TEMPLATE
    assert sorted(ours.chat_templates) == ["default", "tool_use"]
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False)
    write_config(tmp_path, chat_template=[{"name": "tool_use", "template": "TOOLS"}])
    tok = Tokenizer.from_pretrained(tmp_path)  # usable for text; chat needs a choice
    assert tok.encode("hello") == ours.encode("hello")
    with pytest.raises(ValueError, match=r"chat_template: none is named 'default'; this "
                       r"tokenizer has \['tool_use'\]"):
        tok.apply_chat_template(MESSAGES)
    tok.chat_template = tok.chat_templates["tool_use"]
    assert tok.apply_chat_template(MESSAGES) == "TOOLS"


@pytest.mark.parametrize(("changes", "error", "message"), [
    ({"chat_template": 3}, TypeError, "chat_template: expected a string or a list of"),
    ({"chat_template": {"default": "x"}}, TypeError, "chat_template: expected a string"),
    ({"chat_template": [{"name": "default"}]}, TypeError, "chat_template: expected a string"),
    ({"chat_template": "{% for m in messages %}"}, ValueError,
     "chat_template 'default' is not a valid Jinja template"),
    ({"eos_token": 7}, TypeError, "eos_token: expected a string, null or"),
    ({"pad_token": {"content": ["<|endoftext|>"]}}, TypeError, "pad_token: expected a string"),
    ({"bos_token": {"content": "<bos>"}}, ValueError, "bos_token '<bos>' is not in the "
                                                      "vocabulary"),
])
def test_bad_tokenizer_config_names_the_file(tmp_path, changes, error, message) -> None:
    make_tokenizer(tmp_path)
    write_config(tmp_path, **changes)
    with pytest.raises(error, match=rf"^{tmp_path / 'tokenizer_config.json'}: .*{message}"):
        Tokenizer.from_pretrained(tmp_path)


def test_unreadable_files_name_the_file(tmp_path) -> None:
    make_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('["not", "an object"]')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: expected a JSON object"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: not valid JSON"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_bytes(b"\xff{{ x }}")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: not UTF-8 text"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(ValueError, match=r"chat_template\.jinja: chat_template 'default' is "
                       "not a valid Jinja template"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    for garbled in ("{garbage", '{"model": 3}', ""):
        (tmp_path / "tokenizer.json").write_text(garbled)
        with pytest.raises(ValueError, match=r"tokenizer\.json: not a readable tokenizers file"):
            Tokenizer.from_pretrained(tmp_path)


def test_bad_arguments(tmp_path) -> None:
    make_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    for ids in ([1, -1], [1, True], [1, 2.0], torch.tensor([[1, 2]]), torch.tensor([1.0])):
        with pytest.raises(ValueError, match="ids: expected"):
            tok.decode(ids)
    with pytest.raises(TypeError, match="ids: expected a sequence of token ids, got str"):
        tok.decode("12")
    assert tok.decode([tok.encode("hello")[0], tok.vocab_size + 5]) == tok.decode(
        tok.encode("hello")[:1])  # ids above the vocabulary decode to nothing, as in HF
    with pytest.raises(TypeError, match="texts: expected a list of strings, got one str"):
        tok.batch_encode("hello")
    with pytest.raises(TypeError, match="messages: expected a list of dicts"):
        tok.apply_chat_template({"role": "user", "content": "hi"})
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: the chat template cannot "
                       r"render the messages \(UndefinedError, template line 3: "):
        tok.apply_chat_template([{"role": "user"}])  # no content: the template fails
    with pytest.raises(TypeError, match="chat_template: expected a string or None"):
        Tokenizer(tok.backend, chat_template=["x"])
    with pytest.raises(TypeError, match="special_tokens: eos_token should be a string or None"):
        Tokenizer(tok.backend, special_tokens={"eos_token": 3})  # was a bare TypeError
    with pytest.raises(ValueError, match=r"special_tokens: unknown roles \['eos'\]"):
        Tokenizer(tok.backend, special_tokens={"eos": "<|im_end|>"})  # was silently ignored


def test_encode_lets_other_threads_run(tmp_path) -> None:
    """A large text's encoding (seconds) leaves the GIL to other threads (a server's event
    loop): this thread's small steps, each needing the GIL, all run while it is encoding."""
    make_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    text = "the quick brown fox jumps over the world " * 30_000  # 1.2 MB
    started, ids = threading.Event(), []

    def work() -> None:
        started.set()
        ids.append(tok.encode(text))

    thread = threading.Thread(target=work)
    thread.start()
    started.wait()
    for _ in range(3):
        time.sleep(0.001)  # gives the GIL up and takes it back
    still_encoding = thread.is_alive()
    thread.join()
    assert still_encoding, "encode held the GIL: no other thread ran until it ended"
    assert ids[0] == tok.backend.encode(text).ids


@pytest.mark.parametrize(("template", "error"), [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% include 'x' %}", "TypeError"),
    ("{{ 'a' * 10**10 }}", "MemoryError"),  # refused by the worker's 1 GiB, nothing allocated
])
def test_a_failing_template_file_is_named(tmp_path, template, error) -> None:
    make_tokenizer(tmp_path, inline_template=False)
    (tmp_path / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'chat_template.jinja'}: the chat "
                       rf"template cannot render the messages \({error}, template line 1"):
        tok.apply_chat_template(MESSAGES)


def test_a_template_too_deeply_nested_is_refused_at_load(tmp_path) -> None:
    make_tokenizer(tmp_path, inline_template=False)
    (tmp_path / "chat_template.jinja").write_text("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'chat_template.jinja'}: chat_template "
                       r"'default' is nested too deeply to parse"):
        Tokenizer.from_pretrained(tmp_path)


def test_a_text_too_long_for_max_tokens_is_refused_before_tokenizing(tmp_path) -> None:
    """More characters than ``max_tokens`` times the longest token's cannot fit: refused at
    once (a 30 M-character rendered prompt took two minutes to tokenize, then was refused)."""
    make_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    longest = max(map(len, tok.backend.get_vocab(with_added_tokens=True)))
    fits = "a" * (8 * longest)
    assert tok.encode(fits, max_tokens=8) == tok.encode(fits)  # at the bound: tokenized
    calls = []
    tok.backend = types.SimpleNamespace(encode_batch=lambda *a, **k: calls.append(1),
                                        get_vocab=tok.backend.get_vocab)
    with pytest.raises(ValueError, match=rf"^text: {8 * longest + 1} characters are more than "
                       rf"8 tokens can hold \(the longest token has {longest} characters\)"):
        tok.encode(fits + "a", max_tokens=8)
    with pytest.raises(ValueError, match=r"the rendered prompt: text: \d+ characters are more "
                       "than 2 tokens can hold"):
        tok.apply_chat_template(MESSAGES, tokenize=True, max_tokens=2)
    assert not calls


def test_streamer_keeps_only_the_special_tokens_asked(tmp_path) -> None:
    """``keep`` writes the text of the special tokens named (a tool call's marker) while the
    others are still dropped; without it every special token is dropped, as before."""
    make_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    ids = tok.encode("<|im_start|>the fox<|im_end|>")
    kept: list[str] = []
    streamer = TextStreamer(tok, kept.append, keep={tok.token_to_id("<|im_start|>")})
    for i in ids:
        streamer.put(torch.tensor([i]))
    streamer.end()
    assert streamer.text == "<|im_start|>the fox"
    assert tok.decode(ids, True, keep={tok.eos_token_id}) == "the fox<|im_end|>"
    assert tok.decode(ids, True) == "the fox"


def test_a_missing_bos_token_renders_as_nothing_as_in_transformers(tmp_path) -> None:
    """A tokenizer without ``bos_token`` leaves it undefined in the template, so
    ``{{ bos_token }}`` writes "" (not "None") and ``bos_token is defined`` is false."""
    transformers = pytest.importorskip("transformers")
    make_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    template = "[{{ bos_token }}]{% if bos_token is defined %}bos{% endif %}{{ eos_token }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "chat_template": template}))
    ours = Tokenizer.from_pretrained(tmp_path)
    assert ours.bos_token is None
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(
        MESSAGES, tokenize=False) == "[]<|im_end|>"
