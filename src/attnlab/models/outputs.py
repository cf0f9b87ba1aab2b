"""What a model returns when it is called Hugging Face style, and the loss it computes.

``model(ids)`` returns the logits tensor, as it always has. Any of the Hugging Face keywords
``labels``, ``past_key_values``, ``use_cache`` or ``return_dict=True`` makes it return an
output object instead (``DecoderLM``: ``CausalLMOutput``; ``Transformer``:
``Seq2SeqLMOutput``) with ``.logits``, ``.loss`` and ``.past_key_values``.

The loss is next-token cross-entropy with the labels shifted inside, as transformers does:
the logits at position ``t`` predict ``labels[:, t + 1]``, so ``labels`` is the input itself
(with ``-100`` where no loss is wanted, e.g. padding or the prompt):

    loss = mean over {(b, t) : labels[b, t + 1] != -100} of
           -log softmax(logits[b, t])[labels[b, t + 1]]

computed in float32 whatever the logits' dtype (NaN when no label counts, as in transformers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab._checks import ID_DTYPES, check_tensor, is_int
from attnlab.attention.kv_cache import KVCache

__all__ = ["IGNORE_INDEX", "CausalLMOutput", "Seq2SeqLMOutput", "check_hf_keywords",
           "check_labels", "next_token_loss"]

IGNORE_INDEX = -100  # transformers' label for "no loss here"


@dataclass(frozen=True)
class CausalLMOutput:
    """``logits`` ``B x L x V``; ``loss`` a 0-d float32 tensor (with ``labels``); the
    ``KVCache`` ``past_key_values`` holding every position so far (with a cache)."""

    logits: Tensor
    loss: Tensor | None = None
    past_key_values: KVCache | None = None


@dataclass(frozen=True)
class Seq2SeqLMOutput(CausalLMOutput):
    """``CausalLMOutput`` for an encoder-decoder, plus the encoder's output
    ``encoder_last_hidden_state`` ``B x S x E`` (the memory the decoder attended to)."""

    encoder_last_hidden_state: Tensor | None = None


def next_token_loss(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX
                    ) -> Tensor:
    """Mean cross-entropy of ``logits[:, t]`` (``B x L x V``) against ``labels[:, t + 1]``
    (``B x L`` ids, ``ignore_index`` skipped); formula in the module docstring. A 0-d float32
    tensor."""
    V = logits.shape[-1]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, V), labels[:, 1:].reshape(-1).long(),
        ignore_index=ignore_index)


def check_hf_keywords(*, labels: object, use_cache: object, past_key_values: object,
                      cache: object, return_dict: object, logits_to_keep: object = 0) -> bool:
    """Check the Hugging Face keywords of a forward; whether it returns an output object.

    ``labels`` is checked by ``check_labels`` once the input is; ``use_cache``,
    ``return_dict``: ``None`` or a bool;
    ``past_key_values``: ``None`` or a ``KVCache``, not together with ``cache`` (the same
    thing under attnlab's name) nor with ``use_cache=False``. ``return_dict=False`` is refused
    with ``labels`` or a cache (a tensor cannot carry them), and ``labels`` with
    ``logits_to_keep > 0`` (the loss needs every position's logits).
    """
    for name, value in (("use_cache", use_cache), ("return_dict", return_dict)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name}: expected True, False or None, got {value!r}")
    if past_key_values is not None:
        if not isinstance(past_key_values, KVCache):
            raise TypeError(f"past_key_values: expected a KVCache (model.make_cache, or the "
                            f"past_key_values of an earlier output) or None, got "
                            f"{type(past_key_values).__name__}")
        if cache is not None:
            raise ValueError("past_key_values: the same as cache= (attnlab's name for it); "
                             "got both, expected one")
        if use_cache is False:
            raise ValueError("use_cache: False contradicts the past_key_values given; expected "
                             "True or None with a cache")
    if labels is not None and is_int(logits_to_keep) and logits_to_keep > 0:
        raise ValueError(f"logits_to_keep: the loss needs the logits of every position, "
                         f"expected 0 with labels, got {logits_to_keep}")
    hf = labels is not None or past_key_values is not None or use_cache is not None
    if return_dict is False and (labels is not None or past_key_values is not None
                                 or use_cache):
        raise ValueError("return_dict: False returns the logits tensor alone, which cannot "
                         "carry the loss or the cache asked for; expected True or None")
    return bool(return_dict) or (hf and return_dict is None)


def check_labels(labels: object, shape: tuple[int, int], vocab_size: int) -> Tensor:
    """``labels`` when it is a tensor of integer ids in ``[0, vocab_size)`` or ``-100`` of the
    input's ``shape`` ``B x L``; else a ``TypeError``/``ValueError`` naming ``labels``."""
    check_tensor("labels", labels, "a tensor of token ids (or -100) of shape B x L")
    if labels.dtype not in ID_DTYPES or tuple(labels.shape) != shape:
        raise ValueError(f"labels: expected integer ids (torch.long or torch.int32) of the "
                         f"input's shape B x L = {shape}, got shape {tuple(labels.shape)} "
                         f"and dtype {labels.dtype}")
    bad = labels[((labels < 0) | (labels >= vocab_size)) & (labels != IGNORE_INDEX)]
    if bad.numel():
        raise ValueError(f"labels: expected ids in [0, {vocab_size}) or {IGNORE_INDEX} "
                         f"(no loss), got {bad[:5].tolist()}")
    return labels
