"""``attnlab.serving.tool_calls``: each family's format parsed into calls (several per answer,
arguments re-serialized as JSON, malformed output left whole as content), the parser chosen
from the template and the family, the forced call's JSON Schema (checked with ``jsonschema``
and compiled by llguidance), and streaming that assembles to the same message."""

from __future__ import annotations

import json

import pytest

from attnlab.serving.tool_calls import (
    PARSERS,
    ToolCall,
    ToolStream,
    choose_parser,
    forced_schema,
    parse_forced,
)

hermes, llama, mistral = PARSERS["hermes"], PARSERS["llama3_json"], PARSERS["mistral"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]


def test_hermes_several_calls_and_content() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":  "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name":"now","arguments":{}}\n</tool_call>')
    content, calls = hermes.parse(text)
    assert content == "Let me look.\n"
    assert calls == [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("now", "{}")]


def test_hermes_answer_without_calls_is_content() -> None:
    assert hermes.parse("just text") == ("just text", [])
    assert hermes.parse("") == (None, [])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',   # JSON cut short
    '<tool_call>{"arguments": {}}</tool_call>',                         # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',           # not an object
    '<tool_call>{"name": "f", "arguments": {}, "x": 1}</tool_call>',    # a stray key
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": ',  # one cut
])
def test_hermes_malformed_is_left_as_content(text: str) -> None:
    assert hermes.parse(text) == (text, [])


def test_hermes_last_block_open_counts_when_whole() -> None:
    assert hermes.parse('<tool_call>{"name": "f", "arguments": {}}') == (
        None, [ToolCall("f", "{}")])


def test_arguments_are_reserialized_json() -> None:
    _, [call] = hermes.parse('<tool_call>{"name":"f","arguments":{"x":[1,2.5e0],"y":"é"}}'
                             '</tool_call>')
    assert call.arguments == '{"x": [1, 2.5], "y": "é"}'
    assert json.loads(call.arguments) == {"x": [1, 2.5], "y": "é"}
    item = call.openai("call_1")
    assert item == {"id": "call_1", "type": "function",
                    "function": {"name": "f", "arguments": call.arguments}}
    assert call.openai()["id"].startswith("call_")


def test_llama3_json_calls() -> None:
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "now", "parameters": {}}')
    assert llama.parse(text) == (None, [ToolCall("get_weather", '{"city": "Oslo"}'),
                                        ToolCall("now", "{}")])
    assert llama.parse('{"name": "now", "arguments": {}}') == (None, [ToolCall("now", "{}")])


@pytest.mark.parametrize("text", ["The weather is fine.", '{"name": "now", "parameters": {}} ok',
                                  '{"name": "now", "parameters": {}', '{"city": "Oslo"}'])
def test_llama3_json_other_answers_are_content(text: str) -> None:
    assert llama.parse(text) == (text, [])


def test_mistral_calls() -> None:
    text = ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
            '{"name": "now", "arguments": {}}]')
    assert mistral.parse(text) == ("Sure. ", [ToolCall("get_weather", '{"city": "Rome"}'),
                                              ToolCall("now", "{}")])


def test_mistral_v11_calls() -> None:
    """Mistral's v11 form: ``name[ARGS]{...}`` after each ``[TOOL_CALLS]``, a ``[CALL_ID]``
    read past."""
    text = ('Sure. [TOOL_CALLS]get_weather[ARGS]{"city":  "Rome"}'
            '[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{}')
    assert mistral.parse(text) == ("Sure. ", [ToolCall("get_weather", '{"city": "Rome"}'),
                                              ToolCall("now", "{}")])
    assert mistral.parse("[TOOL_CALLS]now[ARGS]{}") == (None, [ToolCall("now", "{}")])


@pytest.mark.parametrize("text", ['[TOOL_CALLS][{"name": "now", "arguments": {}}',
                                  '[TOOL_CALLS][]', '[TOOL_CALLS]{"name": "now"} x', "plain",
                                  '[TOOL_CALLS]now[ARGS]{"a": ', '[TOOL_CALLS]now{}',
                                  '[TOOL_CALLS]now[ARGS][1]', "[TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]",
                                  '[TOOL_CALLS]two words[ARGS]{}'])
def test_mistral_malformed_is_left_as_content(text: str) -> None:
    assert mistral.parse(text) == (text, [])


QWEN_TEMPLATE = "{% if tools %}<tools>{{ tools | tojson }}</tools> <tool_call>{% endif %}"
LLAMA_TEMPLATE = ('{% if tools %}{"name": function name, "parameters": ...}{% endif %}'
                  "{% if message.role == 'ipython' %}{% endif %}")


def test_parser_chosen_by_template_then_family() -> None:
    assert choose_parser("llama", QWEN_TEMPLATE) is hermes  # the template's format wins
    assert choose_parser("qwen2", LLAMA_TEMPLATE) is llama
    assert choose_parser("llama", "[TOOL_CALLS] {{ tools }}") is mistral
    assert choose_parser("qwen3", "{{ tools }}") is hermes
    assert choose_parser("mistral", "{{ tools }}") is mistral
    assert choose_parser("gpt2", "{{ tools }}") is None


def test_forced_schema_of_a_named_function() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = forced_schema(hermes, TOOLS, "get_weather")
    assert schema["properties"]["arguments"] == WEATHER
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    for wrong in ({"name": "now", "arguments": {"city": "Oslo"}},
                  {"name": "get_weather", "arguments": {}},
                  {"name": "get_weather", "arguments": {"city": "Oslo"}, "x": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert forced_schema(llama, TOOLS, "now")["required"] == ["name", "parameters"]
    with pytest.raises(ValueError, match="name: no function 'nope' in tools"):
        forced_schema(hermes, TOOLS, "nope")


def test_forced_schema_required_is_one_or_more_calls() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    several = forced_schema(hermes, TOOLS)
    jsonschema.validate([{"name": "now", "arguments": {}},
                         {"name": "get_weather", "arguments": {"city": "A"}}], several)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], several)
    one = forced_schema(hermes, TOOLS, parallel=False)
    jsonschema.validate({"name": "now", "arguments": {}}, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "now", "arguments": {"x": 1}}, one)


def test_forced_schema_compiles_in_the_grammar_engine(qwen2_folder) -> None:
    """Each forced schema is one llguidance enforces (no keyword refused)."""
    from attnlab.generation.grammar import JsonSchemaGrammar
    from attnlab.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(qwen2_folder)
    for schema in (forced_schema(hermes, TOOLS, "get_weather"), forced_schema(hermes, TOOLS),
                   forced_schema(llama, TOOLS, parallel=False)):
        JsonSchemaGrammar(schema, tok, vocab_size=tok.vocab_size, eos_token_id=0)


def test_parse_forced() -> None:
    assert parse_forced(hermes, '{"name": "now", "arguments": {}}') == [ToolCall("now", "{}")]
    assert parse_forced(llama, '[{"name": "now", "parameters": {}},'
                               '{"name": "f", "parameters": {"a": 1}}]') == [
        ToolCall("now", "{}"), ToolCall("f", '{"a": 1}')]
    assert parse_forced(hermes, '{"name": "now", "argu') is None  # cut by length
    assert parse_forced(hermes, "[]") is None


@pytest.mark.parametrize(("parser", "text", "forced"), [
    (hermes, 'Hi there <tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
             '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', False),
    (hermes, "\n <tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>", False),
    (hermes, "plain <tool_ca text <tool_call> broken", False),
    (llama, '{"name": "now", "parameters": {}}; {"name": "f", "parameters": {}}', False),
    (llama, "  not a call {", False),
    (mistral, 'ok [TOOL_CALLS][{"name": "now", "arguments": {}}]', False),
    (mistral, 'ok [TOOL_CALLS]now[ARGS]{}[TOOL_CALLS]f[ARGS]{"a": 1}', False),
    (hermes, '[{"name": "now", "arguments": {}}]', True),
    (hermes, '{"name": "now", "argu', True),
])
def test_stream_assembles_to_the_parsed_message(parser, text: str, forced: bool) -> None:
    """Fed one character at a time, the content sent plus the end equals the whole answer's
    parse; nothing of a call is ever sent as content."""
    stream = ToolStream(parser, forced=forced)
    sent = "".join(stream.push(c) for c in text)
    rest, calls = stream.finish()
    if forced:
        expected_calls = parse_forced(parser, text) or []
        expected = None if expected_calls else text
    else:
        expected, expected_calls = parser.parse(text)
    assert ((sent + rest) or None) == expected
    assert calls == expected_calls
    if calls:
        assert "{" not in sent and (parser.marker or "@") not in sent
