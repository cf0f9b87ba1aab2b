"""What ``generate`` does per step for OpenAI's request controls, kept out of its loop: the
presence/frequency penalties, the logit bias and the grammar mask (``Controls``), and the
log-probabilities it records for ``logprobs=k`` (``LogprobRecord`` -> ``GenerationOutput``).

Shapes: logits ``B x V``, the generated ids so far ``B x n``, ``finished`` ``B`` bool (rows that
are done: left as they are, their tokens are padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.generation.grammar import JsonSchemaGrammar
from attnlab.generation.logprobs import check_top_logprobs, prompt_logprobs, step_logprobs
from attnlab.generation.processors import (
    FREQUENCY_RANGE,
    apply_logit_bias,
    apply_penalties,
    logit_bias_tensor,
    per_row,
    token_counts,
)

__all__ = ["Controls", "GenerationOutput", "LogprobRecord"]


@dataclass
class GenerationOutput:
    """``generate(..., logprobs=k)``'s result.

    sequences ``B x (P + n)``: the ids, as ``generate`` returns them otherwise. Per new token
    (``B x n``, NaN where a row had finished): ``logprobs`` of the chosen token,
    ``top_ids`` / ``top_logprobs`` ``B x n x k`` of the ``k`` most likely. With
    ``prompt_logprobs=True``, the same for the prompt (``B x P``; NaN at each row's first real
    token and at its padding), else ``None``. All are the model's ``log_softmax`` before any
    processor (``attnlab.generation.logprobs``, which turns a row into OpenAI's forms).
    """

    sequences: Tensor
    logprobs: Tensor
    top_ids: Tensor
    top_logprobs: Tensor
    prompt_logprobs: Tensor | None = None
    prompt_top_ids: Tensor | None = None
    prompt_top_logprobs: Tensor | None = None


class Controls:
    """The per-step processors of one ``generate`` call; ``make`` checks the arguments."""

    def __init__(self) -> None:
        self.presence: Tensor | None = None
        self.frequency: Tensor | None = None
        self.bias: Tensor | None = None
        self.states: list | None = None
        self.record: LogprobRecord | None = None
        # whether process or advance does anything: set by make, read by the loop per step
        self.active = False

    @classmethod
    def make(cls, batch_size: int, vocab_size: int, *, min_p: object, presence_penalty: object,
             frequency_penalty: object, logit_bias: object, grammar: object, logprobs: object,
             prompt_logprobs: object, eos: tuple[int, ...] | None) -> Controls:
        """Check every argument (errors name it and its range) before any compute; ``eos``:
        the end ids of the generation, which must hold the grammar's."""
        self = cls()
        B, V = batch_size, vocab_size
        if min_p is not None:
            per_row("min_p", min_p, B, (0.0, 1.0))
        presence = per_row("presence_penalty", presence_penalty, B, FREQUENCY_RANGE)
        frequency = per_row("frequency_penalty", frequency_penalty, B, FREQUENCY_RANGE)
        if bool((presence != 0).any()) or bool((frequency != 0).any()):
            self.presence, self.frequency = presence, frequency
        if logit_bias is not None:
            self.bias = logit_bias_tensor(logit_bias, B, V)
        if grammar is not None:
            if not isinstance(grammar, JsonSchemaGrammar):
                raise TypeError(f"grammar: expected an attnlab.generation.grammar."
                                f"JsonSchemaGrammar, got {type(grammar).__name__}")
            if grammar.vocab_size != V:
                raise ValueError(f"grammar: compiled for a vocabulary of {grammar.vocab_size} "
                                 f"tokens, expected the model's {V}")
            if eos is None or not set(grammar.eos_token_id) <= set(eos):
                raise ValueError(f"grammar: closes a value with end ids "
                                 f"{list(grammar.eos_token_id)}, which eos_token_id ({eos}) "
                                 "must hold for the row to end there")
            self.states = [grammar.start() for _ in range(B)]
        if logprobs is not None:
            self.record = LogprobRecord(check_top_logprobs(logprobs))
        elif prompt_logprobs:
            raise ValueError("prompt_logprobs: the prompt's log-probabilities come with "
                             "logprobs=k (the alternatives per token); got logprobs=None")
        self.active = any(x is not None for x in (self.presence, self.bias, self.states))
        return self

    def process(self, logits: Tensor, new_ids: Tensor, finished: Tensor) -> Tensor:
        """Penalties, bias, grammar mask: logits ``B x V`` -> ``B x V`` (new_ids ``B x n``)."""
        if self.presence is not None:
            # OpenAI's counts: the tokens generated so far (not the prompt's, as in vLLM).
            counts = token_counts(new_ids, logits.shape[-1])
            logits = apply_penalties(logits, counts, self.presence.flatten(),
                                     self.frequency.flatten())
        if self.bias is not None:
            logits = apply_logit_bias(logits, self.bias.to(logits.device))
        if self.states is not None:
            # A complete value allows only the end ids: the row then ends as any other does.
            allowed = torch.stack([
                torch.ones(logits.shape[-1], dtype=torch.bool) if done else state.allowed()
                for state, done in zip(self.states, finished.tolist())])
            logits = logits.masked_fill(~allowed.to(logits.device), -math.inf)
        return logits

    def advance(self, tokens: Tensor, finished: Tensor) -> None:
        """Feed each running row's grammar state its token (``B``)."""
        if self.states is None:
            return
        for state, token, was in zip(self.states, tokens.tolist(), finished.tolist()):
            if not was and not state.done:
                state.advance(token)


class LogprobRecord:
    """Collects ``step_logprobs`` per step (and ``prompt_logprobs`` once) for
    ``GenerationOutput``."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.steps: list[tuple[Tensor, Tensor, Tensor]] = []
        self.prompt_values: tuple[Tensor, Tensor, Tensor] | None = None

    def prompt(self, logits: Tensor, ids: Tensor, mask: Tensor) -> None:
        """logits ``B x P x V`` of the whole prompt; padding and each row's first real token
        get NaN (no value)."""
        chosen, top_ids, top_values = prompt_logprobs(logits, ids, self.k)
        first_real = mask.argmax(dim=1, keepdim=True)
        none = (mask == 0) | (torch.arange(mask.shape[1]) <= first_real)
        chosen = chosen.masked_fill(none, math.nan)
        top_values = top_values.masked_fill(none[..., None], math.nan)
        top_ids = top_ids.masked_fill(none[..., None], -1)
        self.prompt_values = (chosen, top_ids, top_values)

    def step(self, logits: Tensor, tokens: Tensor, finished: Tensor) -> None:
        chosen, top_ids, top_values = step_logprobs(logits, tokens, self.k)
        self.steps.append((chosen.masked_fill(finished, math.nan),
                           top_ids.masked_fill(finished[:, None], -1),
                           top_values.masked_fill(finished[:, None], math.nan)))

    def output(self, sequences: Tensor) -> GenerationOutput:
        B = sequences.shape[0]
        if self.steps:
            chosen, top_ids, top_values = (torch.stack(parts, dim=1)
                                           for parts in zip(*self.steps))
        else:
            chosen = torch.empty(B, 0)
            top_ids = torch.empty(B, 0, self.k, dtype=torch.long)
            top_values = torch.empty(B, 0, self.k)
        prompt = self.prompt_values or (None, None, None)
        return GenerationOutput(sequences, chosen, top_ids, top_values, *prompt)

