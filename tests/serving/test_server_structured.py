"""``response_format`` in ``attnlab serve``: ``json_object`` and ``json_schema`` enforced while
decoding by the grammar engine (``attnlab.generation.grammar``), per request inside the
continuous batch. Every answer of a random-weight model that ends with ``stop`` parses and
validates with ``jsonschema``, under 8 concurrent clients, as each does alone; a schema
keyword the engine cannot enforce is a 400 naming it."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
from server_live import raw, server_fixtures

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                 "minItems": 1, "maxItems": 3}},
     "required": ["name", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "kind": {"enum": ["fox", "world", "time"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "score": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["kind", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "inner": {"type": "object", "properties": {
            "ok": {"type": "boolean"},
            "code": {"type": "string", "pattern": "^[a-c]{2}[0-9]$"}},
            "required": ["ok", "code"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 4}},
     "required": ["inner"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 2, "maxItems": 4},
]


server, api, tok = server_fixtures(max_batch=8, page_size=4, kv_pages=512)


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                   "strict": True}}


def _ask(api, folder, schema: dict, seed: int, chat: bool) -> list[tuple[str, str]]:
    common = {"model": folder.name, "max_tokens": 48, "temperature": 1.0, "seed": seed,
              "n": 2, "response_format": _format(schema)}
    if chat:
        out = api.chat.completions.create(
            messages=[{"role": "user", "content": "the fox said"}], **common)
        return [(c.message.content, c.finish_reason) for c in out.choices]
    # response_format is chat's field in the client; completions take it through extra_body
    fmt = common.pop("response_format")
    out = api.completions.create(prompt="once upon a time", extra_body={"response_format": fmt},
                                 **common)
    return [(c.text, c.finish_reason) for c in out.choices]


def test_outputs_that_stop_validate_under_eight_clients(api, qwen2_folder) -> None:
    jobs = [(schema, seed, chat) for seed, schema in enumerate(SCHEMAS)
            for chat in (False, True)]
    alone = [_ask(api, qwen2_folder, *job) for job in jobs]
    together: dict[int, list] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(
        i, _ask(api, qwen2_folder, *jobs[i]))) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert [together.get(i) for i in range(len(jobs))] == alone
    stopped = 0
    for (schema, _, _), answers in zip(jobs, alone):
        for text, finish in answers:
            if finish == "stop":
                jsonschema.validate(json.loads(text), schema)
                stopped += 1
            else:  # cut by max_tokens: not a whole value, so never reported as one
                assert finish == "length"
    assert stopped >= len(jobs)  # most end: the schemas bound their strings and arrays


def test_json_object_gives_an_object(api, qwen2_folder) -> None:
    out = api.chat.completions.create(
        model=qwen2_folder.name, messages=[{"role": "user", "content": "hello"}],
        max_tokens=48, temperature=1.0, seed=1, n=4, response_format={"type": "json_object"})
    ended = [c.message.content for c in out.choices if c.finish_reason == "stop"]
    assert all(isinstance(json.loads(text), dict) for text in ended)


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "not": {"required": ["a"]}}, "not"),
])
def test_a_schema_the_engine_cannot_enforce_is_a_400_naming_it(server, qwen2_folder, schema,
                                                               keyword) -> None:
    status, _, text = raw(server[1], "POST", "/v1/chat/completions", {
        "model": qwen2_folder.name, "messages": [{"role": "user", "content": "hi"}],
        "response_format": _format(schema)})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == "response_format" and keyword in error["message"]


@pytest.mark.parametrize("fmt", [{"type": "xml"}, {"type": "json_schema"},
                                 {"type": "json_schema", "json_schema": {"schema": {}}}])
def test_a_malformed_response_format_is_a_400(server, qwen2_folder, fmt) -> None:
    status, _, text = raw(server[1], "POST", "/v1/chat/completions", {
        "model": qwen2_folder.name, "messages": [{"role": "user", "content": "hi"}],
        "response_format": fmt})
    assert status == 400 and json.loads(text)["error"]["param"] == "response_format", text
