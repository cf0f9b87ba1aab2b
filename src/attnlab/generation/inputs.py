"""Argument checks for generation, run before any compute so that a bad argument gives a
``ValueError`` naming it instead of an ``IndexError`` from an embedding halfway through.

Single token ids (end, pad) must lie in ``[0, V)`` for the model's vocabulary size ``V``;
prompts are checked by ``attnlab._checks.check_token_ids``. Lengths count the prompt
(``P``) and the new tokens against the model's limit of positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnlab._checks import is_int

__all__ = ["new_token_count", "token_id", "token_id_set"]


def token_id(name: str, value: object, vocab_size: int) -> int:
    """``value`` as an int when it is one id in ``[0, V)`` (an int or a 0-d integer tensor)."""
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    if not is_int(value):
        raise TypeError(f"{name}: expected a token id (an int), got {value!r}")
    if not 0 <= value < vocab_size:
        raise ValueError(f"{name}: expected a token id in [0, {vocab_size}) (the model's "
                         f"vocabulary), got {value}")
    return value


def token_id_set(name: str, value: object, vocab_size: int) -> tuple[int, ...]:
    """One id or several (a list, a tuple or a 0-d/1-d tensor) -> a non-empty tuple of ids."""
    if isinstance(value, Tensor) and value.dim() == 1:
        value = list(value.unbind())
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) == 0:
            raise ValueError(f"{name}: expected one token id or a non-empty list of them, got "
                             f"{value!r}")
        return tuple(token_id(f"{name}[{i}]", v, vocab_size) for i, v in enumerate(value))
    return (token_id(name, value, vocab_size),)


def new_token_count(prompt_length: int, limit: int, max_new_tokens: object,
                    max_length: object) -> int:
    """How many tokens to add to a prompt of ``P`` tokens, from ``max_new_tokens`` (new ones)
    or ``max_length`` (prompt + new, as in Hugging Face); ``limit`` is the model's number of
    positions. Both given must agree."""
    plen = prompt_length
    if max_new_tokens is None and max_length is None:
        raise ValueError("max_new_tokens: expected max_new_tokens (new tokens) or max_length "
                         "(prompt + new tokens), got neither")
    if plen > limit:  # first: a caller's "limit - P" would otherwise be a puzzling -144
        raise ValueError(f"input_ids: the prompt has {plen} tokens, more than the model's "
                         f"limit of {limit} positions")
    for name, value in (("max_new_tokens", max_new_tokens), ("max_length", max_length)):
        if value is not None and (not is_int(value)
                                  or value < 0):
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    if max_length is not None and max_length < plen:
        raise ValueError(f"max_length: expected at least the prompt length {plen} (max_length "
                         f"counts the prompt and the new tokens), got {max_length}")
    if max_new_tokens is not None and max_length is not None \
            and plen + max_new_tokens != max_length:
        raise ValueError(f"max_length: {max_length} contradicts max_new_tokens={max_new_tokens} "
                         f"for a prompt of {plen} tokens ({plen} + {max_new_tokens} = "
                         f"{plen + max_new_tokens}); give one of them (max_length counts the "
                         "prompt and the new tokens, max_new_tokens only the new ones)")
    if max_new_tokens is not None:
        name, given, n = "max_new_tokens", max_new_tokens, max_new_tokens
    else:
        name, given, n = "max_length", max_length, max_length - plen
    if plen + n > limit:
        raise ValueError(f"{name}: the prompt has {plen} tokens and the model takes at most "
                         f"{limit} positions, so at most {limit - plen} new tokens fit; got "
                         f"{name}={given}")
    return n
