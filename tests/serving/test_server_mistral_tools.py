"""Mistral's tool calls as a real Mistral tokenizer makes them: ``[TOOL_CALLS]`` and ``[ARGS]``
are special tokens, which decoded text drops, so the server keeps their text in the answers of
a request with tools (only there) for the parser to read Mistral's v11 form
``[TOOL_CALLS]name[ARGS]{...}``; driven by the official ``openai`` client, streamed and not.
Also ``/tokenize`` with ``messages`` and ``tools``: the ids the chat route gives the model.

The folder: the tiny BPE with Mistral's control tokens added as special tokens, a Mistral-style
template (no ``bos_token`` in the folder: it renders as nothing) and a model that is a bigram
table: its layers' outputs are zero (``o_proj``, ``down_proj``), so the last position's logits
are ``lm_head(norm(embedding))`` of the last token, and one-hot embeddings chain
``[/INST] -> [TOOL_CALLS] -> get_weather -> [ARGS] -> {"city":"Paris"} -> [TOOL_CALLS] ...``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from server_live import client, live, raw
from test_server_tools import ASK, TOOLS, assembled, served
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from attnlab.models.decoder import DecoderLM
from attnlab.models.families import FAMILIES
from attnlab.models.io import save_pretrained

# Mistral's v11 template in short: tools before the last user turn, v11 calls, tool results.
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{%- endif %}"
    "[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}"
    "{%- endfor %}{{ eos_token }}"
    "{%- elif message.role == 'assistant' %}{{ message.content }}{{ eos_token }}"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- endif %}"
    "{%- endfor %}")
CONTROL = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[AVAILABLE_TOOLS]",
           "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
NAME, ARGS = "get_weather", '{"city":"Paris"}'
CHAIN = ["[/INST]", "[TOOL_CALLS]", NAME, "[ARGS]", ARGS]  # each token's next, in a loop


@pytest.fixture(scope="module")
def mistral_folder(qwen2_folder, tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral") / "model"
    shutil.copytree(qwen2_folder, path)
    tok = Backend.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in (NAME, ARGS)])
    tok.save(str(path / "tokenizer.json"))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    del settings["chat_template"]
    assert "bos_token" not in settings
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    (path / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)

    ids = [tok.token_to_id(t) for t in CHAIN]
    config = FAMILIES["mistral"].config_from_hf(
        {"vocab_size": tok.get_vocab_size(), "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 2048, "tie_word_embeddings": False,
         "eos_token_id": tok.token_to_id(settings["eos_token"])})
    model = DecoderLM(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight",
                              "lm_head.weight")):
                weight.zero_()
        for k, token in enumerate(ids):
            model.embed_tokens.weight[token, k] = 1.0
            model.lm_head.weight[ids[k + 1] if k + 1 < len(ids) else ids[1], k] = 10.0
    save_pretrained(model, path)
    return path


@pytest.fixture(scope="module")
def mistral(mistral_folder):
    app, added = served(mistral_folder)
    with live(app) as url:
        yield client(url), added, mistral_folder.name, url


def test_v11_calls_through_special_tokens(mistral) -> None:
    """The answer's tokens are [TOOL_CALLS] get_weather [ARGS] {...} twice: both calls are
    parsed, without streaming and streamed alike."""
    api, _, name, _ = mistral
    out = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=8,
                                      temperature=0)
    choice = out.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        (NAME, '{"city": "Paris"}')] * 2
    stream = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=8,
                                         temperature=0, stream=True)
    content, calls, finishes = assembled(stream)
    assert content is None and calls == [(NAME, '{"city": "Paris"}')] * 2
    assert finishes[-1] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools", [{}, {"tools": TOOLS, "tool_choice": "none"}])
def test_answers_without_tools_drop_the_special_tokens(mistral, stream, tools) -> None:
    """Without tools to call, the special tokens' text stays out of the answer, as before."""
    api, _, name, _ = mistral
    out = api.chat.completions.create(model=name, messages=ASK, max_tokens=8, temperature=0,
                                      stream=stream, **tools)
    if stream:
        content, calls, finishes = assembled(out)
    else:
        choice = out.choices[0]
        content, calls, finishes = (choice.message.content, choice.message.tool_calls or [],
                                    [choice.finish_reason])
    assert content == (NAME + ARGS) * 2 and calls == [] and finishes[-1] == "length"


def test_tokenize_renders_tools_as_the_chat_route(mistral) -> None:
    """/tokenize with messages and tools gives the ids the chat route fed the model (the tools
    in the prompt), and a missing bos_token renders as nothing."""
    api, added, name, url = mistral
    added.clear()
    api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=1)
    def post(path: str, body: dict) -> tuple[int, dict | str]:
        status, _, text = raw(url, "POST", path, {"model": name, **body})
        return status, json.loads(text) if status == 200 else text

    _, with_tools = post("/tokenize", {"messages": ASK, "tools": TOOLS})
    _, plain = post("/tokenize", {"messages": ASK})
    assert with_tools["tokens"] == added[0][0] and with_tools["count"] == len(added[0][0])
    assert len(plain["tokens"]) < len(with_tools["tokens"])
    _, text = post("/detokenize", {"tokens": plain["tokens"]})
    assert text["prompt"] == "[INST]weather in Paris?[/INST]"
    status, refused = post("/tokenize", {"prompt": "hi", "tools": TOOLS})
    assert status == 400 and "tools: only with messages" in refused
