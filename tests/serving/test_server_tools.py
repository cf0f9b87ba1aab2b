"""``attnlab serve``'s tool calling, driven by the official ``openai`` client on a live server:
``tools`` rendered by a Qwen2.5-style chat template (the prompt equal to transformers'
rendering), the answer's ``<tool_call>`` blocks parsed into ``message.tool_calls`` with
``finish_reason: "tool_calls"``, streamed ``delta.tool_calls`` assembling to the same calls,
the client's ``tool`` messages rendered back, ``tool_choice`` (``none``, ``required``, a named
function: the call's JSON Schema handed to the engine) and the refusals.

Two folders: a random-weight Qwen2 with the Qwen2.5-style template, and a "caller" whose
greedy answer is known: its ``lm_head`` is zero, so every logit is 0 and argmax picks id 0,
which its tokenizer gives to one (non-special) token spelling a whole ``<tool_call>`` block.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from server_live import client, live
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from attnlab.models.decoder import DecoderLM
from attnlab.models.families import FAMILIES
from attnlab.models.io import save_pretrained
from attnlab.serving.server import create_app
from attnlab.serving.tool_calls import PARSERS, forced_schema

# Qwen2.5-Instruct's chat template, as its tokenizer_config.json has it (tools in the system
# turn, <tool_call> blocks, tool results in <tool_response> blocks of a user turn).
QWEN25_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Llama 3.1-Instruct's chat template (its JSON tool calling; the builtin tools left out): tools
# in the first user turn, calls as {"name", "parameters"}, tool results in ipython turns.
LLAMA31_TEMPLATE = """\
{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first \
user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument \
name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ \
message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
CITY = {"type": "string", "enum": ["Paris", "Oslo"]}
WEATHER = {"type": "object", "properties": {"city": CITY}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "weather in Paris?"}]
# The callers' one answer token: a whole call, as Qwen2.5 and Llama 3.1 write one.
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city":"Paris"}}'


def with_template(source, path, template=QWEN25_TEMPLATE):
    """A copy of the tiny folder ``source`` with ``template`` (and a bos token, which Llama
    3.1's template writes)."""
    shutil.copytree(source, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps({**config,
                                                            "bos_token": "<|im_start|>"}))
    (path / "chat_template.jinja").write_text(template)
    return path


def save_model(path, vocab: int, *, zero_head: bool = False, family: str = "qwen2") -> None:
    """A random tiny model with room for the tools' prompt (the tiny tokenizer spells the
    template's system turn in some 800 tokens)."""
    config = FAMILIES[family].config_from_hf(
        {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 2048, "tie_word_embeddings": False,
         "initializer_range": 0.2})
    torch.manual_seed(0)
    model = DecoderLM(config)
    if zero_head:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    save_pretrained(model, path)


@pytest.fixture(scope="module")
def qwen_folder(qwen2_folder, tmp_path_factory):
    """A random-weight Qwen2 folder with the Qwen2.5 template."""
    path = with_template(qwen2_folder, tmp_path_factory.mktemp("qwen25") / "model")
    save_model(path, Backend.from_file(str(path / "tokenizer.json")).get_vocab_size())
    return path


def make_caller(path, call: str, family: str) -> None:
    """Make the folder at ``path`` one whose greedy answer is ``call``, ``call``, ...:
    ``call`` takes id 0 (the id of <|im_start|>, which moves to the new id), and a zero
    lm_head makes every logit 0."""
    tok = Backend.from_file(str(path / "tokenizer.json"))
    tok.add_tokens([AddedToken(call, normalized=False, special=False)])
    data = json.loads(tok.to_str())
    new = tok.get_vocab_size() - 1
    for entry in data["added_tokens"]:
        entry["id"] = {0: new, new: 0}.get(entry["id"], entry["id"])
    # Ids of added tokens are kept on loading only when the model's vocabulary has them.
    data["model"]["vocab"].update({"<|im_start|>": new, call: 0})
    (path / "tokenizer.json").write_text(json.dumps(data))
    assert Backend.from_file(str(path / "tokenizer.json")).token_to_id(call) == 0
    save_model(path, new + 1, zero_head=True, family=family)


@pytest.fixture(scope="module")
def caller_folder(qwen2_folder, tmp_path_factory):
    """A Qwen2 folder with the Qwen2.5 template that answers CALL, CALL, ..."""
    path = with_template(qwen2_folder, tmp_path_factory.mktemp("caller") / "model")
    make_caller(path, CALL, "qwen2")
    return path


@pytest.fixture(scope="module")
def llama_folder(qwen2_folder, tmp_path_factory):
    """A Llama folder with the Llama 3.1 template that answers LLAMA_CALL, ..."""
    path = with_template(qwen2_folder, tmp_path_factory.mktemp("llama") / "model",
                         LLAMA31_TEMPLATE)
    make_caller(path, LLAMA_CALL, "llama")
    return path


def served(folder):
    """A live server on ``folder`` whose engine requests are recorded: ``(prompt ids,
    SamplingParams)`` each."""
    app = create_app(folder, max_batch=4, page_size=16, kv_pages=512)
    added = []
    engine = app.state.serving.engine
    add = engine.add

    async def recorded(ids, params, events):
        added.append((list(ids), params))
        return await add(ids, params, events)

    engine.add = recorded
    return app, added


@pytest.fixture(scope="module")
def caller(caller_folder):
    app, added = served(caller_folder)
    with live(app) as url:
        yield client(url), added, caller_folder.name


@pytest.fixture(scope="module")
def qwen(qwen_folder):
    app, added = served(qwen_folder)
    with live(app) as url:
        yield client(url), added, qwen_folder.name


def hf_prompt(folder, messages, tools=None) -> list[int]:
    """transformers' rendering of ``messages`` with the folder's template, tokenized."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                              bos_token="<|im_start|>")
    hf.chat_template = (folder / "chat_template.jinja").read_text()
    return hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                  tokenize=True, return_dict=False)


def assembled(stream) -> tuple[str | None, list[tuple[str, str]], list[str | None]]:
    """A streamed choice's content, calls (name, arguments) and finish reasons."""
    content, calls, finishes = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""),
                                     args + (call.function.arguments or ""))
            finishes.append(choice.finish_reason)
    return content or None, [calls[k] for k in sorted(calls)], finishes


def test_tool_calling_loop(caller, caller_folder) -> None:
    """Tools reach the template; two calls come back parsed (arguments re-serialized), the
    same when streamed; the client answers each with a tool message, which the template
    renders as transformers does, and the conversation goes on."""
    api, added, name = caller
    added.clear()
    out = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=2,
                                      temperature=0)
    assert added[0][0] == hf_prompt(caller_folder, ASK, TOOLS)
    assert added[0][1].json_schema is None  # "auto": the model chooses
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, c.function.arguments) for c in calls] == [
        ("function", "get_weather", '{"city": "Paris"}')] * 2
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)

    stream = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=2,
                                         temperature=0, stream=True)
    content, streamed, finishes = assembled(stream)
    assert content is None
    assert streamed == [(c.function.name, c.function.arguments) for c in calls]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}

    back = [*ASK, choice.message.model_dump(exclude_none=True),
            *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls),
            {"role": "assistant", "content": "It is sunny.", "tool_calls": []},
            {"role": "user", "content": "and now?"}]
    added.clear()
    again = api.chat.completions.create(model=name, messages=back, tools=TOOLS, max_tokens=1,
                                        temperature=0)
    assert again.choices[0].finish_reason == "tool_calls"
    expected = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}} for c in calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"} for c in calls),
        {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "and now?"}]
    assert added[0][0] == hf_prompt(caller_folder, expected, TOOLS)


def test_llama31_json_calls(llama_folder) -> None:
    """Llama 3.1's template and format: the tools in the first user turn, the answer's bare
    JSON call parsed (its "parameters" as the arguments), the ipython turn rendered back as
    transformers renders it."""
    app, added = served(llama_folder)
    with live(app) as url:
        api, name = client(url), llama_folder.name
        out = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=1,
                                          temperature=0)
        assert added[0][0] == hf_prompt(llama_folder, ASK, TOOLS)
        choice = out.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        [call] = choice.message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_weather",
                                                                 '{"city": "Paris"}')
        back = [*ASK, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        api.chat.completions.create(model=name, messages=back, tools=TOOLS, max_tokens=1)
    expected = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert added[1][0] == hf_prompt(llama_folder, expected, TOOLS)


def test_several_choices_each_parsed(caller) -> None:
    """n = 2: each choice's calls, streamed or not."""
    api, _, name = caller
    out = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=1,
                                      temperature=0, n=2)
    assert [len(c.message.tool_calls) for c in out.choices] == [1, 1]
    stream = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=1,
                                         temperature=0, n=2, stream=True)
    calls: dict[int, list[str]] = {0: [], 1: []}
    for chunk in stream:
        for choice in chunk.choices:
            calls[choice.index] += [c.function.name for c in choice.delta.tool_calls or ()]
    assert calls == {0: ["get_weather"], 1: ["get_weather"]}


def test_tool_choice_none_leaves_the_text_alone(caller) -> None:
    """tool_choice "none": the tools are not rendered and the text is not parsed."""
    api, added, name = caller
    added.clear()
    out = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=2,
                                      temperature=0, tool_choice="none")
    assert out.choices[0].message.content == CALL * 2
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "length"
    plain = api.chat.completions.create(model=name, messages=ASK, max_tokens=1)
    assert added[0][0] == added[1][0]  # the same prompt as without tools
    assert plain.choices[0].message.tool_calls is None


@pytest.mark.parametrize(("choice", "parallel", "expected"), [
    ({"type": "function", "function": {"name": "get_weather"}}, None, "get_weather"),
    ("required", None, None),
    ("required", False, None),
])
def test_forced_choice_hands_the_call_schema_to_the_engine(qwen, choice, parallel,
                                                           expected) -> None:
    api, added, name = qwen
    added.clear()
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=1,
                                tool_choice=choice, **extra)
    assert added[0][1].json_schema == forced_schema(PARSERS["hermes"], TOOLS, expected,
                                                    parallel=parallel is not False)


def test_forced_tool_call_loop_on_random_weights(qwen) -> None:
    """A random-weight model, forced by tool_choice, calls the function with arguments that
    fit its schema (the grammar engine holds it to them), streamed or not; the client
    returns a tool message and the conversation continues."""
    api, _, name = qwen
    force = {"type": "function", "function": {"name": "get_weather"}}
    out = api.chat.completions.create(model=name, messages=ASK, tools=TOOLS, max_tokens=100,
                                      temperature=0, tool_choice=force)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in CITY["enum"]
    content, streamed, _ = assembled(api.chat.completions.create(
        model=name, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0,
        tool_choice=force, stream=True))
    assert (content, streamed) == (None, [("get_weather", call.function.arguments)])
    back = [*ASK, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    again = api.chat.completions.create(model=name, messages=back, tools=TOOLS, max_tokens=4,
                                        temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_forced_parameters_the_grammar_engine_cannot_enforce_are_refused(qwen) -> None:
    """A forced call's schema holds the function's parameters: a keyword the grammar engine
    cannot enforce is a 400 naming it (never a looser constraint); with "auto" nothing is
    enforced, so the same tools are taken."""
    openai = pytest.importorskip("openai")
    api, _, name = qwen
    unique = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}}}]
    with pytest.raises(openai.BadRequestError) as error:
        api.chat.completions.create(model=name, messages=ASK, tools=unique, max_tokens=1,
                                    tool_choice="required")
    assert error.value.body["param"] == "tools"
    assert '["uniqueItems"]' in error.value.body["message"]
    api.chat.completions.create(model=name, messages=ASK, tools=unique, max_tokens=1)


def test_template_without_tools_is_refused(qwen2_folder) -> None:
    openai = pytest.importorskip("openai")
    app = create_app(qwen2_folder, max_batch=1, page_size=4, kv_pages=64)
    with live(app) as url, pytest.raises(openai.BadRequestError) as error:
        client(url).chat.completions.create(model=qwen2_folder.name, messages=ASK,
                                            tools=TOOLS, max_tokens=1)
    assert error.value.body["param"] == "tools"
    assert "does not render tools" in error.value.body["message"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names the function 'nope'"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "'required' needs tools"),
    ({"tools": [*TOOLS, TOOLS[0]]}, "tools", "each function needs its own name"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls", "only in an assistant message"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1.tool_call_id",
     "expected in a tool message"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content",
     "only an assistant message with tool_calls may leave it out"),
])
def test_bad_tool_requests_are_refused_by_name(qwen, body, param, words) -> None:
    openai = pytest.importorskip("openai")
    api, _, name = qwen
    request = {"model": name, "messages": ASK, "tools": TOOLS, "max_tokens": 1, **body}
    with pytest.raises(openai.BadRequestError) as error:
        api.chat.completions.create(**{k: v for k, v in request.items() if v is not None})
    assert error.value.body["param"] == param
    assert words in error.value.body["message"]
