"""``attnlab generate``: stream text from a Hugging Face-format checkpoint folder of any family
that ``attnlab.models.from_pretrained`` reads (``config.json`` ``model_type``: see
``attnlab.models.families``), or one written by our ``save_pretrained``.

    attnlab generate --model DIR --prompt "Once upon a time" [--chat] [--max-new-tokens 64]
                     [--do-sample --temperature 0.7 --top-k 50 --top-p 0.9 --seed 0]
                     [--stop "\\n\\n"] [--speculative ngram|ngram:K|self:N|draft:DIR]
                     [--min-p P --presence-penalty X --frequency-penalty X --logit-bias ID=B]
                     [--json-schema FILE]

Every generation flag defaults to the folder's ``generation_config.json`` (as Hugging Face's
``generate`` does), and to the built-in default when the file does not set it; a flag given
on the command line wins. The text goes to stdout token by token; a summary (prompt tokens,
prefill time, new tokens and decode tokens/s; with ``--speculative`` the drafts accepted and
the tokens per pass) goes to stderr at the end.

``--json-schema FILE`` constrains the output to a JSON value of that schema while decoding
(``attnlab.generation.grammar``); a keyword the engine cannot enforce is refused by name, and
an output cut by the token limit is said to be incomplete on stderr.

``--speculative`` (``attnlab.generation.speculative``; the text is the same as without it):
``ngram[:K]`` proposes the ``K`` (default 10) tokens that followed the latest earlier match
of the text's last words (prompt lookup), ``self:N`` drafts with the model's first ``N``
layers, ``draft:DIR`` with a smaller model of the same tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass

import torch

from attnlab.arg_types import (
    non_negative_int,
    number,
    positive_float,
    positive_int,
    probability,
)
from attnlab.cli import add_command
from attnlab.cli.options import add_dtype_option, add_model_option
from attnlab.generation import SpeculativeStats, generate
from attnlab.generation.config import GenerationConfig, read_generation_config
from attnlab.generation.grammar import JsonSchemaGrammar
from attnlab.generation.inputs import token_id, token_id_set
from attnlab.generation.proposers import parse_speculative
from attnlab.models.decoder import DecoderLM
from attnlab.models.families import family_for
from attnlab.models.gguf import gguf_file
from attnlab.models.hf_loading import CONFIG_NAME, check_folder, read_json
from attnlab.models.io import from_pretrained
from attnlab.threads import add_threads_option
from attnlab.tokenizer import TextStreamer, Tokenizer
from attnlab.training.checkpoint import FORMAT as TRAINING_CHECKPOINT

__all__ = ["GenerateSettings", "add_commands", "check_model_type", "resolve_settings",
           "run_generate"]

DEFAULT_MAX_NEW_TOKENS = 128
_FROM_FILE = "default: generation_config.json's, else"
_DESCRIPTION = ("Stream text from a checkpoint folder. Each generation flag defaults to the "
                "folder's generation_config.json (as in Hugging Face), else to the built-in "
                "default; a flag given here wins. End tokens: the file's eos_token_id, else "
                "config.json's and the tokenizer's.")


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``generate`` on the top-level sub-parsers."""
    # Defaults are written in the help texts: the flags default to None ("not given").
    p = add_command(sub, "generate", _DESCRIPTION)
    add_model_option(p, help="folder with config.json (its model_type one "
                   "that attnlab reads), model.safetensors (or a sharded index), tokenizer.json, "
                   "tokenizer_config.json and, optionally, generation_config.json; or a GGUF "
                   "file (an Ollama blob too), or a folder holding one")
    p.add_argument("--prompt", required=True, help="the prompt (the user message with --chat)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--system", default=None, help="a system message for --chat (default: none)")
    p.add_argument("--max-new-tokens", type=non_negative_int, default=None, metavar="N",
                   help=f"new tokens at most ({_FROM_FILE} {DEFAULT_MAX_NEW_TOKENS}; a default "
                   "is capped at the model's limit of positions)")
    p.add_argument("--max-length", type=non_negative_int, default=None, metavar="N",
                   help="prompt + new tokens at most, as Hugging Face's max_length (default: "
                   "generation_config.json's when it sets no max_new_tokens)")
    p.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None,
                   help=f"sample with --temperature/--top-k/--top-p; --no-do-sample: greedy "
                   f"({_FROM_FILE} greedy)")
    p.add_argument("--temperature", type=_temperature, default=None, metavar="T",
                   help=f"divide the logits by T before sampling; 0: greedy ({_FROM_FILE} 1.0)")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help=f"sample among the K most likely tokens only ({_FROM_FILE} all)")
    p.add_argument("--top-p", type=probability, default=None, metavar="P",
                   help=f"sample among the most likely tokens whose probabilities add up to P, "
                   f"0 < P <= 1 ({_FROM_FILE} 1.0: all)")
    p.add_argument("--repetition-penalty", type=positive_float, default=None, metavar="R",
                   help=f"CTRL's penalty on tokens already in the text, R > 1 repeats less "
                   f"({_FROM_FILE} 1.0: none)")
    p.add_argument("--min-p", type=_min_p, default=None, metavar="P",
                   help=f"sample only among tokens at least P times as likely as the most "
                   f"likely one, 0 <= P <= 1 ({_FROM_FILE} 0: all)")
    p.add_argument("--presence-penalty", type=_penalty, default=0.0, metavar="X",
                   help="OpenAI's presence penalty, -2..2: subtract X from the logit of every "
                   "token already generated")
    p.add_argument("--frequency-penalty", type=_penalty, default=0.0, metavar="X",
                   help="OpenAI's frequency penalty, -2..2: subtract X times the number of "
                   "times a token was generated from its logit")
    p.add_argument("--logit-bias", action="append", type=_bias, default=None, metavar="ID=B",
                   help="add B (-100..100) to token ID's logit at every step; repeat for "
                   "several (default: none)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to a JSON value of the JSON Schema in FILE "
                   "(default: free text)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", type=_text,
                   help="stop when the new text contains TEXT (printed); repeat for several "
                   "(default: none)")
    p.add_argument("--speculative", type=_speculative, default=None,
                   metavar="ngram[:K]|self:N|draft:DIR",
                   help="speculative decoding, same text, fewer passes over the weights: "
                   "prompt lookup of K tokens (default 10), the model's first N layers as a "
                   "draft, or a smaller model with the same tokenizer (default: off)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling, for reproducible output (default: random)")
    add_dtype_option(p, "weights dtype (default: the checkpoint's)")
    add_threads_option(p)
    p.set_defaults(handler=run_generate)


@dataclass(frozen=True)
class GenerateSettings:
    """What ``attnlab generate`` passes to ``generate``, flags and file defaults merged.

    ``capped`` is True when a default (not a flag) was cut to fit the model's limit.
    """

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    repetition_penalty: float
    min_p: float | None
    eos_token_id: tuple[int, ...] | None
    pad_token_id: int | None
    capped: bool = False


def resolve_settings(args: argparse.Namespace, file: GenerationConfig, *, prompt_length: int,
                     limit: int, vocab_size: int, fallback_eos: tuple[int, ...]
                     ) -> GenerateSettings:
    """Merge the flags of ``args`` (``None`` = not given) over ``file``'s defaults over the
    built-in ones, and check them together, naming flags and file fields as the user wrote
    them. ``limit``: the model's positions; ``fallback_eos``: end ids when the file has none."""
    def pick(flag: str, default: object) -> tuple[object, str]:
        given = getattr(args, flag)
        if given is not None:
            return given, "--" + flag.replace("_", "-")
        if getattr(file, flag) is not None:
            return getattr(file, flag), f"{flag} in {file.path}"
        return default, "the default"

    do_sample, sample_source = pick("do_sample", False)
    temperature, temperature_source = pick("temperature", 1.0)
    if args.temperature == 0 and args.do_sample is None:
        do_sample = False  # --temperature 0 asks for greedy, over the file's do_sample
    if do_sample and temperature == 0:
        raise ValueError(f"{temperature_source}: expected a temperature > 0 for sampling "
                         f"({sample_source}), got 0; temperature 0 means greedy decoding "
                         "(--no-do-sample)")
    new_tokens, capped = _new_tokens(args, file, prompt_length, limit)
    eos_source = f"eos_token_id in {file.path}"
    if file.eos_token_id is not None:
        eos = token_id_set(eos_source, file.eos_token_id, vocab_size)
    else:
        eos = token_id_set("eos_token_id of config.json and tokenizer_config.json",
                           fallback_eos, vocab_size) if fallback_eos else None
    pad = (None if file.pad_token_id is None
           else token_id(f"pad_token_id in {file.path}", file.pad_token_id, vocab_size))
    return GenerateSettings(
        max_new_tokens=new_tokens, do_sample=bool(do_sample), temperature=float(temperature),
        top_k=pick("top_k", None)[0], top_p=pick("top_p", None)[0],
        repetition_penalty=float(pick("repetition_penalty", 1.0)[0]),
        min_p=pick("min_p", None)[0], eos_token_id=eos,
        pad_token_id=pad, capped=capped)


def run_generate(args: argparse.Namespace) -> int:
    """Load, render the prompt, generate with a ``TextStreamer`` and print the summary."""
    check_model_type(args.model)
    file = read_generation_config(args.model)
    tokenizer = Tokenizer.from_pretrained(args.model)
    model = from_pretrained(args.model, dtype=args.dtype)
    if args.chat:
        messages = [{"role": "user", "content": args.prompt}]
        if args.system is not None:
            messages.insert(0, {"role": "system", "content": args.system})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            max_tokens=model.config.max_len)
    else:
        try:
            ids = tokenizer.encode(args.prompt, max_tokens=model.config.max_len)
        except ValueError as error:
            raise ValueError(f"--prompt: {error}: longer than the model's context") from None
    if not ids:
        raise ValueError(f"--prompt: expected text that encodes to >= 1 token, got "
                         f"{args.prompt!r}")
    config = model.config
    fallback = [tokenizer.eos_token_id, *config.eos_token_id]
    fallback_eos = tuple(dict.fromkeys(i for i in fallback if i is not None))
    s = resolve_settings(args, file, prompt_length=len(ids), limit=config.max_len,
                         vocab_size=config.vocab_size, fallback_eos=fallback_eos)
    unused = [flag for flag in ("temperature", "top_k", "top_p", "min_p")
              if getattr(args, flag) not in (None, 0) and not s.do_sample]
    if unused:
        flags = ", ".join("--" + f.replace("_", "-") for f in unused)
        print(f"attnlab: note: {flags} unused: greedy decoding (add --do-sample to sample)",
              file=sys.stderr)
    speculative, stats = _speculative_kwargs(args.speculative, model, args.dtype), None
    if speculative:
        stats = speculative["speculative_stats"] = SpeculativeStats()
    controls = _controls(args, tokenizer, config.vocab_size, s.eos_token_id)
    streamer = _TimedStreamer(tokenizer)
    start = time.perf_counter()
    out = generate(model, torch.tensor([ids]), s.max_new_tokens, do_sample=s.do_sample,
                   temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                   repetition_penalty=s.repetition_penalty, eos_token_id=s.eos_token_id,
                   pad_token_id=s.pad_token_id, stop_strings=args.stop,
                   tokenizer=tokenizer if args.stop else None, seed=args.seed,
                   streamer=streamer, min_p=s.min_p, **controls, **speculative)
    end = time.perf_counter()
    if "grammar" in controls and (out.shape[1] == len(ids)
                                  or int(out[0, -1]) not in s.eos_token_id):
        print("attnlab: note: the JSON is incomplete: generation stopped at the token limit "
              "(--max-new-tokens) before the value was complete", file=sys.stderr)
    print(file=sys.stdout, flush=True)
    dtype = str(model.dtype).removeprefix("torch.")
    threads = torch.get_num_threads()
    machine = f"{dtype}, {threads} thread{'s' if threads != 1 else ''}"
    notes = [f"new tokens capped at {s.max_new_tokens} by the model's limit of "
             f"{config.max_len} positions"] if s.capped else []
    if stats is not None:
        notes.append(f"speculative {args.speculative[0]}: {stats.accepted} of {stats.proposed} "
                     f"drafts accepted, {stats.tokens_per_pass:.2f} tokens per pass")
    note = "; ".join(notes) or None
    print(summary(len(ids), streamer.count, start, streamer.first_time, end, note=note,
                  machine=machine), file=sys.stderr)
    return 0


def _controls(args: argparse.Namespace, tokenizer: Tokenizer, vocab_size: int,
              eos: tuple[int, ...] | None) -> dict:
    """``generate``'s keywords for the penalties, --logit-bias and --json-schema (read and
    compiled here; errors name the flag and the file)."""
    out = {"presence_penalty": args.presence_penalty,
           "frequency_penalty": args.frequency_penalty}
    if args.logit_bias:
        bias = dict(args.logit_bias)
        bad = next((i for i in bias if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise ValueError(f"--logit-bias: expected token ids in [0, {vocab_size}) (the "
                             f"model's vocabulary), got {bad}")
        out["logit_bias"] = bias
    if args.json_schema is not None:
        if not eos:
            raise ValueError("--json-schema: a JSON value ends with an end token, and this "
                             "model has none (eos_token_id in generation_config.json, "
                             "config.json or tokenizer_config.json)")
        try:
            with open(args.json_schema, encoding="utf-8") as file:
                schema = json.load(file)
            out["grammar"] = JsonSchemaGrammar(schema, tokenizer, vocab_size=vocab_size,
                                               eos_token_id=eos)
        except (OSError, ValueError) as error:
            raise ValueError(f"--json-schema: {args.json_schema}: {error}") from None
    return out


def check_model_type(folder: str) -> None:
    """Refuse, before anything is loaded, a ``--model`` folder whose ``config.json`` names a
    ``model_type`` that no family reads (listing those that are read), or that holds an
    attnlab training checkpoint (``attnlab sample`` continues those). attnlab's own decoder
    format (``save_pretrained`` of a ``DecoderLM``, e.g. ``attnlab quantize``'s output) is read,
    and so is a GGUF file (its header is checked when it is loaded)."""
    if gguf_file(folder) is not None:
        return
    file = check_folder(folder) / CONFIG_NAME
    config = read_json(file)
    if config.get("format") == TRAINING_CHECKPOINT:
        raise ValueError(f"--model: {file} is an attnlab training checkpoint (model_type "
                         f"{config.get('model_type')!r}); expected a Hugging Face-format "
                         "folder. `attnlab sample --model` continues text with a "
                         "checkpoint of `attnlab train lm`")
    if config.get("model_type") == DecoderLM.MODEL_TYPE:
        return
    try:
        family_for(config.get("model_type"))
    except ValueError as error:
        raise ValueError(f"--model: {file}: {error}") from None


def summary(prompt_tokens: int, new_tokens: int, start: float, first: float | None,
            end: float, *, note: str | None, machine: str) -> str:
    """The stderr line after generation. Prefill is the time to the first token; the decode
    rate counts the tokens after it, so it needs two tokens or more (else it is not printed:
    ``0 / 0`` would be ``nan``)."""
    parts = [f"{prompt_tokens} prompt tokens"]
    if new_tokens == 0 or first is None:
        parts.append("0 new tokens (the model was not run)")
    else:
        parts.append(f"prefill {1e3 * (first - start):.0f} ms")
        plural = "" if new_tokens == 1 else "s"
        text = f"{new_tokens} new token{plural} in {end - start:.2f} s"
        if new_tokens > 1 and end > first:
            text += f", decode {(new_tokens - 1) / (end - first):.1f} tokens/s"
        else:
            text += " (a decode rate needs 2 new tokens or more)"
        parts.append(text)
    if note:
        parts.append(note)
    return f"[{'; '.join(parts)}; {machine}]"


def _new_tokens(args: argparse.Namespace, file: GenerationConfig, prompt_length: int,
                limit: int) -> tuple[int, bool]:
    """New tokens to make and whether a default was capped to fit the model's ``limit``."""
    plen, room = prompt_length, limit - prompt_length
    where = f"the model's limit of {limit} positions (max_position_embeddings in config.json)"
    if room < 0:
        raise ValueError(f"--prompt: encodes to {plen} tokens, more than {where}")
    if args.max_new_tokens is not None and args.max_length is not None \
            and plen + args.max_new_tokens != args.max_length:
        raise ValueError(f"--max-length: {args.max_length} contradicts --max-new-tokens "
                         f"{args.max_new_tokens} for a prompt of {plen} tokens ({plen} + "
                         f"{args.max_new_tokens} = {plen + args.max_new_tokens}); give one of "
                         "them (--max-length counts the prompt and the new tokens)")
    for flag, value, n in (("--max-new-tokens", args.max_new_tokens, args.max_new_tokens),
                           ("--max-length", args.max_length,
                            None if args.max_length is None else args.max_length - plen)):
        if value is None:
            continue
        if n < 0:
            raise ValueError(f"{flag}: expected at least the prompt's {plen} tokens (it counts "
                             f"the prompt and the new tokens), got {value}")
        if n > room:
            raise ValueError(f"{flag}: the prompt has {plen} tokens and {where}, so at most "
                             f"{room} new tokens fit; got {value}")
        return n, False
    if file.max_new_tokens is not None:
        n = file.max_new_tokens
    elif file.max_length is not None:
        n = file.max_length - plen
        if n < 0:
            raise ValueError(f"{file.path}: max_length {file.max_length} leaves no room after "
                             f"the prompt's {plen} tokens; give --max-new-tokens")
    else:
        n = DEFAULT_MAX_NEW_TOKENS
    return min(n, room), n > room


def _speculative(text: str) -> tuple[str, int | str]:
    """``--speculative``: ``ngram[:K]``, ``self:N`` or ``draft:DIR`` -> (kind, K, N or DIR)."""
    try:
        return parse_speculative(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _speculative_kwargs(choice: tuple[str, int | str] | None, model: DecoderLM,
                        dtype: str | None) -> dict:
    """``generate``'s keywords for ``--speculative`` (a draft folder loaded here)."""
    if choice is None:
        return {}
    kind, value = choice
    if kind == "ngram":
        return {"prompt_lookup_num_tokens": value}
    if kind == "self":
        if value >= model.config.num_layers:
            raise ValueError(f"--speculative self:{value}: expected fewer layers than the "
                             f"model's {model.config.num_layers}")
        return {"assistant_early_exit": value}
    try:
        check_model_type(value)
        return {"assistant_model": from_pretrained(value, dtype=dtype)}
    except (ValueError, OSError) as error:
        raise ValueError(f"--speculative draft:{value}: {error}") from None


_temperature = number(float, lambda v: v >= 0 and math.isfinite(v),
                      "a finite number >= 0 (0: greedy)")


_min_p = number(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
_penalty = number(float, lambda v: -2 <= v <= 2, "a number in [-2, 2]")


def _bias(text: str) -> tuple[int, float]:
    """``--logit-bias ID=B`` -> (id, bias), B in [-100, 100]."""
    token, _, value = text.partition("=")
    try:
        pair = int(token), float(value)
    except ValueError:
        pair = None
    if pair is None or not -100 <= pair[1] <= 100 or pair[0] < 0:
        raise argparse.ArgumentTypeError(f"expected ID=B, a token id and a bias in "
                                         f"[-100, 100], got {text!r}")
    return pair


def _text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty text, got ''")
    return text


class _TimedStreamer(TextStreamer):
    """A ``TextStreamer`` that also records when the first token arrived (end of prefill)."""

    first_time: float | None = None

    def put(self, token_ids: torch.Tensor) -> None:
        if self.first_time is None:
            self.first_time = time.perf_counter()
        super().put(token_ids)
