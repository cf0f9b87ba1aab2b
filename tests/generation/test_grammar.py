"""generate(grammar=JsonSchemaGrammar(...)): every output of a random-weight model that ends
with its end token parses and validates with jsonschema, and a row ends only with its end
token (one cut by the token limit is not reported as finished); a keyword the engine cannot
enforce is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from attnlab.generation import generate
from attnlab.generation.grammar import JsonSchemaGrammar, check_schema
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.tokenizer import Tokenizer

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "nested objects": {
        "type": "object", "additionalProperties": False, "required": ["user"],
        "properties": {"user": {
            "type": "object", "additionalProperties": False, "required": ["name", "id"],
            "properties": {"name": {"type": "string", "maxLength": 6},
                           "id": {"type": "integer", "minimum": 0, "maximum": 999}}}}},
    "arrays with bounds": {"type": "array", "minItems": 1, "maxItems": 3,
                           "items": {"type": "integer", "minimum": -5, "maximum": 5}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color"],
              "properties": {"color": {"enum": ["red", "green", "blue"]},
                             "size": {"enum": [1, 2, 3, None]}}},
    "required and optional": {
        "type": "object", "additionalProperties": False, "required": ["ok"],
        "properties": {"ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 4},
                       "tags": {"type": "array", "maxItems": 2,
                                "items": {"type": "string", "maxLength": 3}}}},
    "numbers with ranges": {
        "type": "object", "additionalProperties": False, "required": ["x", "n"],
        "properties": {"x": {"type": "number", "minimum": -1, "exclusiveMaximum": 2},
                       "n": {"type": "integer", "minimum": 10, "maximum": 20}}},
    "strings with patterns": {
        "type": "object", "additionalProperties": False, "required": ["code"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}}},
}
ROWS, NEW_TOKENS = 8, 40


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A byte-level BPE of ~1000 tokens learned from JSON-like text (a real vocabulary's
    shape: multi-character tokens that span quotes, digits and keys)."""
    folder = tmp_path_factory.mktemp("json-tokenizer")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [json.dumps({"user": {"name": "ann", "id": i}, "color": c, "ok": True,
                          "x": i / 7, "code": f"AB-{i:03d}", "tags": ["a", "bc"]})
              for i, c in enumerate(["red", "green", "blue"] * 40)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return Tokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def model(tokenizer: Tokenizer) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderLMConfig.llama(tokenizer.vocab_size, d_model=32, num_layers=2,
                                           num_heads=4, max_len=64)).eval()


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_finished_output_validates(name: str, tokenizer: Tokenizer,
                                         model: DecoderLM) -> None:
    schema = SCHEMAS[name]
    eos = tokenizer.eos_token_id
    grammar = JsonSchemaGrammar(schema, tokenizer, vocab_size=model.config.vocab_size,
                                eos_token_id=eos)
    prompt = torch.tensor([tokenizer.encode("json:")] * ROWS)
    out = generate(model, prompt, NEW_TOKENS, grammar=grammar, do_sample=True, seed=0)
    stopped, pad = 0, eos
    for row in out[:, prompt.shape[1]:].tolist():
        if eos in row:
            stopped += 1
            text = tokenizer.decode(row[:row.index(eos)])
            jsonschema.validate(json.loads(text), schema)
        else:  # no row ends early without its end token: this one was cut by the limit
            assert len(row) == NEW_TOKENS and pad not in row, f"{name}: {row}"
    # Bounded strings and arrays: most rows end within the limit (the test means something).
    assert stopped >= ROWS // 2, f"{name}: only {stopped} of {ROWS} rows ended"


def test_greedy_with_a_schema_and_logprobs_together(tokenizer: Tokenizer,
                                                    model: DecoderLM) -> None:
    """The mask applies before the choice; logprobs stay the model's own (unmasked)."""
    schema = SCHEMAS["enums"]
    grammar = JsonSchemaGrammar(schema, tokenizer, vocab_size=model.config.vocab_size,
                                eos_token_id=tokenizer.eos_token_id)
    prompt = torch.tensor([tokenizer.encode("json:")])
    out = generate(model, prompt, NEW_TOKENS, grammar=grammar, logprobs=2)
    new = out.sequences[0, prompt.shape[1]:].tolist()
    eos = tokenizer.eos_token_id
    assert eos in new
    jsonschema.validate(json.loads(tokenizer.decode(new[:new.index(eos)])), schema)
    assert (out.logprobs[0, :len(new)] <= 0).all()


@pytest.mark.parametrize("keyword", ["uniqueItems", "not", "if"])
def test_a_keyword_the_engine_cannot_enforce_is_refused_by_name(tokenizer: Tokenizer,
                                                                keyword: str) -> None:
    schema = {"uniqueItems": {"type": "array", "uniqueItems": True},
              "not": {"not": {"type": "string"}},
              "if": {"if": {"type": "string"}, "then": {"maxLength": 2}}}[keyword]
    refusal = rf"schema: the grammar engine cannot enforce .*\"{keyword}\""
    with pytest.raises(ValueError, match=refusal):
        JsonSchemaGrammar(schema, tokenizer, vocab_size=tokenizer.vocab_size,
                          eos_token_id=tokenizer.eos_token_id)
    with pytest.raises(ValueError, match=refusal):  # the same without a vocabulary
        check_schema(schema)
    check_schema({"type": "object", "properties": {"a": {"type": "array", "maxItems": 2}}})


def test_json_object_mode_and_bad_arguments(tokenizer: Tokenizer, model: DecoderLM) -> None:
    grammar = JsonSchemaGrammar(None, tokenizer, vocab_size=model.config.vocab_size,
                                eos_token_id=tokenizer.eos_token_id)
    prompt = torch.tensor([tokenizer.encode("json:")] * 4)
    out = generate(model, prompt, NEW_TOKENS, grammar=grammar, do_sample=True, seed=1)
    eos = tokenizer.eos_token_id
    for row in out[:, prompt.shape[1]:].tolist():
        if eos in row:
            assert isinstance(json.loads(tokenizer.decode(row[:row.index(eos)])), dict)
    with pytest.raises(ValueError, match="schema: expected a JSON Schema, got invalid JSON"):
        JsonSchemaGrammar("{", tokenizer, vocab_size=10, eos_token_id=0)
    with pytest.raises(TypeError, match="tokenizer: expected an attnlab Tokenizer"):
        JsonSchemaGrammar({}, object(), vocab_size=10, eos_token_id=0)
    small = JsonSchemaGrammar({}, tokenizer, vocab_size=tokenizer.vocab_size + 8,
                              eos_token_id=eos)
    with pytest.raises(ValueError, match="grammar: compiled for a vocabulary of"):
        generate(model, prompt, 2, grammar=small)
