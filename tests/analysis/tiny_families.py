"""A tiny transformers config of any ``model_type`` that attnlab reads, for the analysis
tests: the same small sizes for every family, plus what a family needs to show its style."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

# Keys that a model_type does not know are kept as plain attributes and ignored by it.
SIZES = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 64, "n_positions": 64, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0}
# A sliding window shorter than the tests' inputs; partial rotary.
STYLE = {"mistral": {"sliding_window": 4}, "phi3": {"partial_rotary_factor": 0.5}}


def tiny_hf_config(model_type: str, vocab_size: int) -> PretrainedConfig:
    """``transformers.AutoConfig.for_model(model_type, ...)`` with the tiny sizes."""
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, **SIZES,
                                **STYLE.get(model_type, {}))
