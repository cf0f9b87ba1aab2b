"""Generation: the KV cache, sampling functions, OpenAI's request controls (``processors``:
penalties, logit bias, min-p; ``logprobs``; ``grammar``: JSON Schema), decoder-only
``generate`` (end ids, stop strings, argument checks), speculative decoding
(``speculative``, ``proposers``), a checkpoint's ``generation_config.json`` defaults
(``config``) and the encoder-decoder greedy / beam search.

The loops know models only through ``protocols.CausalLM`` and ``protocols.Seq2SeqLM``, so
generation sits below ``attnlab.models`` in the import layers (``.importlinter``) and the
models' ``generate`` methods call it."""

from attnlab.attention.kv_cache import KVCache, LayerKVCache
from attnlab.generation.beam import beam_search, generate_seq2seq, greedy_search
from attnlab.generation.controls import GenerationOutput
from attnlab.generation.generate import Streamer, generate
from attnlab.generation.grammar import JsonSchemaGrammar
from attnlab.generation.proposers import DraftModel, PromptLookup, Proposer, early_exit
from attnlab.generation.protocols import CausalLM, Seq2SeqLM
from attnlab.generation.sampling import (
    GreedyTokens,
    apply_repetition_penalty,
    check_logits,
    check_sampling_args,
    greedy_tokens,
    sample_logits,
    sampling_probs,
    top_k_filter,
    top_p_filter,
    unusable_rows,
)
from attnlab.generation.speculative import (
    SpeculativeStats,
    accept_greedy,
    accept_sampled,
    speculative_generate,
)
from attnlab.generation.stopping import StopStrings

__all__ = [
    "CausalLM",
    "DraftModel",
    "GenerationOutput",
    "GreedyTokens",
    "JsonSchemaGrammar",
    "KVCache",
    "LayerKVCache",
    "PromptLookup",
    "Proposer",
    "Seq2SeqLM",
    "SpeculativeStats",
    "StopStrings",
    "Streamer",
    "accept_greedy",
    "accept_sampled",
    "apply_repetition_penalty",
    "beam_search",
    "check_logits",
    "check_sampling_args",
    "early_exit",
    "generate",
    "generate_seq2seq",
    "greedy_search",
    "greedy_tokens",
    "sample_logits",
    "sampling_probs",
    "speculative_generate",
    "top_k_filter",
    "top_p_filter",
    "unusable_rows",
]
