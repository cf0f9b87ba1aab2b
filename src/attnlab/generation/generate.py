"""Autoregressive generation for a decoder-only LM (any ``protocols.CausalLM``, e.g.
``attnlab.models.DecoderLM``, whose ``generate`` method calls this).

One prefill pass runs the whole (left-padded) prompt and fills the KV cache; each later
step feeds only the newest token, at position ``offset = cache.length``. Per step:

    logits = model(last_token, attention_mask, cache, logits_to_keep=1)[:, -1]    B x V
    [logprobs: log_softmax(logits), recorded before anything changes them]
    logits = grammar_mask(bias(penalties(logits)))  (controls.py, each only when asked)
    token = argmax(logits)                           (greedy)
         or token ~ softmax(filter(logits / T))     (sampling: top-k, top-p, min-p)

A row finishes on any of its end ids or when its new text contains a stop string
(``stopping.py``); it is then filled with the pad id, and generation ends when all rows have.
Arguments are checked first (``inputs.py``), so bad ids fail before any compute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from attnlab._checks import check_token_ids, is_int
from attnlab.generation.controls import Controls, GenerationOutput
from attnlab.generation.grammar import JsonSchemaGrammar
from attnlab.generation.inputs import new_token_count, token_id, token_id_set
from attnlab.generation.protocols import CausalLM, CausalLMConfig, Streamer
from attnlab.generation.sampling import (
    apply_repetition_penalty,
    check_logits,
    check_sampling_args,
    greedy_tokens,
    sample_logits,
)
from attnlab.generation.speculative import (
    Decoding,
    SpeculativeStats,
    make_proposer,
    speculative_generate,
)
from attnlab.generation.stopping import Decoder, StopStrings

__all__ = ["GenerationOutput", "Streamer", "generate"]


@torch.no_grad()
def generate(
    model: CausalLM,
    input_ids: Tensor,
    max_new_tokens: int | None = None,
    *,
    max_length: int | None = None,
    attention_mask: Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    eos_token_id: int | Sequence[int] | Tensor | None = None,
    pad_token_id: int | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer: Decoder | None = None,
    seed: int | None = None,
    streamer: Streamer | None = None,
    use_cache: bool = True,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int | None = None,
    assistant_model: CausalLM | None = None,
    assistant_early_exit: int | None = None,
    speculative_stats: SpeculativeStats | None = None,
    min_p: float | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | Sequence[Mapping[int, float] | None] | None = None,
    grammar: JsonSchemaGrammar | None = None,
    logprobs: int | None = None,
    prompt_logprobs: bool = False,
) -> Tensor | GenerationOutput:
    """Extend each prompt of ``input_ids`` (``B x P``) by up to ``max_new_tokens`` tokens.

    Returns ``B x (P + n)`` ids, the prompts followed by the new tokens, ``n <= max_new_tokens``
    (fewer when every row has finished; a finished row is filled with ``pad_token_id``).

    - Length: ``max_new_tokens`` counts the new tokens, ``max_length`` (as in Hugging Face)
      the prompt and the new tokens; give either (both only when they agree).
    - A row finishes when it produces any id of ``eos_token_id`` (one id, or a list/tuple/
      1-d tensor of them), or when its new text (decoded by ``tokenizer``, needed then)
      contains one of ``stop_strings`` (``attnlab.generation.stopping``). ``pad_token_id``
      defaults to the first end id; rows of a batch that stop on a string need one.
    - ``attention_mask`` ``B x P`` (1/True = real token) for prompts of different lengths,
      which must be **left**-padded (padding first), so that every row's next token is last.
    - Greedy (``do_sample=False``; ``temperature``, ``top_k``, ``top_p`` unused, so
      ``temperature=0`` is fine) or sampling with them (``attnlab.generation.sampling``);
      ``seed`` makes sampling reproducible.
    - ``repetition_penalty`` (CTRL) applies to every real token of the row so far.
    - ``streamer.put(ids B)`` is called with each new step's tokens, ``streamer.end()`` once.
    - ``use_cache=False`` recomputes the whole sequence at every step (same result, slower).
    - Speculative decoding (``attnlab.generation.speculative``; one row, unpadded, cached),
      with transformers' names: ``prompt_lookup_num_tokens=k`` proposes the ``k`` tokens
      that followed the last n-gram's latest earlier occurrence (``n <=
      max_matching_ngram_size``, default 3); ``assistant_model`` (a smaller model with the
      same tokenizer) or ``assistant_early_exit=N`` (the model's own first ``N`` layers and
      its head) drafts tokens. The output is the plain decoding's: the same greedy tokens,
      the same sampling distribution. ``speculative_stats`` (a ``SpeculativeStats``) is
      filled in with the acceptance counts.
    - OpenAI's sampling controls (``attnlab.generation.processors``): ``presence_penalty`` and
      ``frequency_penalty`` (``[-2, 2]``) on the tokens generated so far, ``logit_bias``
      (token id -> ``[-100, 100]``, one mapping or one per row), ``min_p`` (``[0, 1]``,
      sampling only). Order per step: repetition penalty, presence/frequency, bias, grammar
      mask, then greedy or temperature, top-k, top-p, min-p.
    - ``grammar`` (``attnlab.generation.grammar.JsonSchemaGrammar``): every row's tokens keep
      the text a prefix of a value of the schema; once the value is complete only the end
      ids are allowed, so the row ends with one (``eos_token_id`` defaults to the grammar's
      end ids, and must hold them).
    - ``logprobs=k`` (``0..20``) returns a ``GenerationOutput``: the ids and, per new token,
      the model's ``log_softmax`` (before every processor) of the chosen token and of the
      ``k`` most likely ones (``attnlab.generation.logprobs``); ``prompt_logprobs=True`` adds
      the prompt's (its first token has none: NaN).

    Every argument is checked before any compute: token ids (prompt, end, pad) must lie in
    the model's vocabulary ``[0, V)``. Logits with NaN or +inf give a ``ValueError``.
    Call ``model.eval()`` first for deterministic dropout-free output.
    """
    if not isinstance(model, CausalLM) or not isinstance(model.config, CausalLMConfig):
        raise TypeError(f"model: expected a causal LM (callable, with make_cache and a config "
                        f"with vocab_size and max_len: attnlab.generation.protocols.CausalLM), "
                        f"got {type(model).__name__}")
    V = model.config.vocab_size
    check_token_ids("input_ids", input_ids, V)
    attention_mask = _check_mask(attention_mask, input_ids)
    B, P = input_ids.shape
    max_new_tokens = new_token_count(P, model.config.max_len, max_new_tokens, max_length)
    check_sampling_args(temperature, top_k, top_p, repetition_penalty, do_sample=do_sample)
    if eos_token_id is None and isinstance(grammar, JsonSchemaGrammar):
        eos_token_id = grammar.eos_token_id
    eos = None if eos_token_id is None else token_id_set("eos_token_id", eos_token_id, V)
    if pad_token_id is not None:
        pad_token_id = token_id("pad_token_id", pad_token_id, V)
    elif eos is not None:
        pad_token_id = eos[0]
    stop = None if stop_strings is None else StopStrings(stop_strings, tokenizer)
    if stop is not None and B > 1 and pad_token_id is None:
        raise ValueError("pad_token_id: rows of a batch that stop on one of stop_strings are "
                         "filled with pad_token_id (default: the first eos_token_id); got "
                         "neither")
    generator = None
    if seed is not None:
        if not is_int(seed) or not -2**63 <= seed < 2**64:
            raise ValueError(f"seed: expected an int in [-2**63, 2**64) (torch's range), got "
                             f"{seed!r}")
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    _refuse_with_speculative(
        prompt_lookup_num_tokens is not None or assistant_model is not None
        or assistant_early_exit is not None,
        min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        logit_bias=logit_bias, grammar=grammar, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs)
    proposer = make_proposer(
        model, input_ids, attention_mask, P + max_new_tokens,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        max_matching_ngram_size=max_matching_ngram_size, assistant_model=assistant_model,
        assistant_early_exit=assistant_early_exit, use_cache=use_cache)
    if proposer is not None:
        decoding = Decoding(do_sample, temperature, top_k, top_p, repetition_penalty,
                            None if eos is None else torch.tensor(eos, device=input_ids.device),
                            stop, generator)
        return speculative_generate(model, input_ids, proposer, max_new_tokens, decoding,
                                    streamer=streamer, stats=speculative_stats)
    if speculative_stats is not None:
        raise ValueError("speculative_stats: counts speculative decoding, which none of "
                         "prompt_lookup_num_tokens, assistant_model, assistant_early_exit asks")
    controls = Controls.make(B, V, min_p=min_p, presence_penalty=presence_penalty,
                             frequency_penalty=frequency_penalty, logit_bias=logit_bias,
                             grammar=grammar, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs, eos=eos)

    ids, mask = input_ids, attention_mask
    eos_ids = None if eos is None else torch.tensor(eos, device=ids.device)
    cache = model.make_cache(B, P + max_new_tokens) if use_cache and max_new_tokens else None
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
    # A model may say that its cached keys go stale at some length (longrope RoPE).
    expires = getattr(model, "cache_expires", lambda length: False)
    # A model may own its greedy choice (a module that a fast one can stand in for).
    greedy = getattr(model, "greedy", greedy_tokens)
    record = controls.record
    if record is not None and prompt_logprobs:
        full = model(ids, attention_mask=mask, cache=cache if max_new_tokens else None)
        record.prompt(full, ids, mask)
        logits = full[:, -1]
    elif max_new_tokens:
        logits = model(ids, attention_mask=mask, cache=cache, logits_to_keep=1)[:, -1]
    for step in range(max_new_tokens):
        raw = logits
        if repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, ids, repetition_penalty, mask)
        if controls.active:
            logits = controls.process(logits, ids[:, P:], finished)
        # Once a step, for greedy and sampling alike; after the penalty, which may overflow.
        name = f"logits (the model's output for new token {step + 1})"
        if do_sample:
            check_logits(logits, name)
            token = sample_logits(logits, temperature, top_k, top_p, generator, check=False,
                                  min_p=min_p)
        else:
            token = greedy(logits)
            # The chosen entry is its row's maximum: NaN or +inf when the row holds one, -inf
            # when every entry is; checking it checks the row, without a second pass.
            check_logits(logits.gather(-1, token[:, None]), name)
        if pad_token_id is not None:
            token = token.masked_fill(finished, pad_token_id)
        if record is not None:
            record.step(raw, token, finished)
        if controls.active:
            controls.advance(token, finished)
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if eos_ids is not None:
            finished |= torch.isin(token, eos_ids)
        if stop is not None:
            finished |= stop(ids[:, P:], ~finished)
        if streamer is not None:
            streamer.put(token)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        if cache is not None and expires(cache.length):  # computed again, all of it
            cache.reset()
            logits = model(ids, attention_mask=mask, cache=cache, logits_to_keep=1)[:, -1]
        elif cache is not None:
            logits = model(token[:, None], attention_mask=mask, cache=cache,
                           logits_to_keep=1)[:, -1]
        else:
            logits = model(ids, attention_mask=mask, logits_to_keep=1)[:, -1]
    if streamer is not None:
        streamer.end()
    return ids if record is None else record.output(ids)


def _refuse_with_speculative(speculative: bool, **controls: object) -> None:
    """Speculative decoding verifies drafts against the plain distribution: the request
    controls are not part of it yet, so asking for both is refused by name."""
    defaults = {"min_p": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "logit_bias": None, "grammar": None, "logprobs": None, "prompt_logprobs": False}
    given = [name for name, value in controls.items() if value != defaults[name]]
    if speculative and given:
        raise ValueError(f"{given[0]}: not available with speculative decoding "
                         "(prompt_lookup_num_tokens, assistant_model, assistant_early_exit); "
                         "use one or the other")


def _check_mask(attention_mask: object, input_ids: Tensor) -> Tensor:
    """The prompt's mask as 0/1 longs ``B x P`` (all ones when not given), left padding only."""
    B, P = input_ids.shape
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.long)
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (B, P):
        got = (tuple(attention_mask.shape) if isinstance(attention_mask, Tensor)
               else type(attention_mask).__name__)
        raise ValueError(f"attention_mask: expected shape B x P = {(B, P)}, got {got}")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError(f"attention_mask: expected 0/1 (or bool) values, got "
                         f"{attention_mask.unique()[:5].tolist()}")
    mask = attention_mask.long()
    if bool((mask[:, -1] == 0).any()) or bool((mask.diff(dim=1) < 0).any()):
        raise ValueError("attention_mask: expected left padding (zeros before ones, a real "
                         f"token last in every row), got {mask.tolist()}")
    return mask
