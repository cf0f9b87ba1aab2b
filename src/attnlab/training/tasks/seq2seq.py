"""Sequence-to-sequence tasks made by generators: dates, copy, reverse, sort, addition.

A task draws the pairs of a training step from ``random.Random((seed, step, micro))``, so the
data is a pure function of the step (exact resume, identical shards under ``torchrun``), and
keeps fixed validation and test sets that are disjoint from training: in dates for the date
task, by a hash of the input for the others.

``Seq2SeqTask.translate_checked`` is the way to run a trained model on a user's inputs: it
refuses, per input, what the model cannot read (empty, too long, characters outside its
vocabulary, not of the task's form) and checks each output (a real calendar date for the
date task), so that one bad input neither fails the batch nor comes back as a made-up answer.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnlab.generation import generate_seq2seq
from attnlab.training.losses import label_smoothed_cross_entropy
from attnlab.training.tasks import dates
from attnlab.training.tasks.vocab import BOS, EOS, PAD, SPECIALS, CharVocab, describe_characters

__all__ = ["SEQ2SEQ_TASKS", "Seq2SeqBatch", "Seq2SeqTask", "Translation", "make_seq2seq_task"]

SEQ2SEQ_TASKS = ("dates", "copy", "reverse", "sort", "add")

Pair = tuple[str, str]
# Why a text is not acceptable (as an input, or as the model's output), or None when it is.
Check = Callable[[str], "str | None"]


@dataclass(frozen=True)
class Translation:
    """One input's result: ``output`` when the model gave a valid answer, else ``error`` says
    why there is none (the input cannot be read, or the output is not a valid answer)."""

    source: str
    output: str | None
    error: str | None = None


@dataclass(frozen=True)
class Seq2SeqBatch:
    """src ``B x S`` ids; tgt_in ``B x T`` (``<bos>`` + target); tgt_out ``B x T``
    (target + ``<eos>``)."""

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor

    def to(self, device: torch.device | str) -> Seq2SeqBatch:
        return Seq2SeqBatch(self.src.to(device), self.tgt_in.to(device), self.tgt_out.to(device))


class Seq2SeqTask:
    """Pairs of strings, character vocabularies, batches, the loss, and evaluation."""

    def __init__(
        self,
        name: str,
        sample: Callable[[random.Random], Pair],
        valid: list[Pair],
        test: list[Pair],
        src_vocab: CharVocab,
        tgt_vocab: CharVocab,
        *,
        seed: int = 0,
        label_smoothing: float = 0.1,
        eval_examples: int = 500,
        max_input_len: int | None = None,
        input_check: Check | None = None,
        output_check: Check | None = None,
    ) -> None:
        """``max_input_len``: the longest input of the task's data (None: only the model's
        limit); ``input_check`` / ``output_check``: the task's own checks of an input and of
        a decoded output (see ``translate_checked``)."""
        self.name, self._sample = name, sample
        self.max_input_len = max_input_len
        self._input_check, self._output_check = input_check, output_check
        self.valid, self.test = valid, test
        self.src_vocab, self.tgt_vocab = src_vocab, tgt_vocab
        self.seed, self.label_smoothing, self.eval_examples = seed, label_smoothing, eval_examples
        self.max_target_len = max(len(t) for _, t in valid + test) + 2

    def pairs(self, step: int, micro: int, size: int) -> list[Pair]:
        """The ``size`` training pairs of micro-batch ``micro`` of ``step``."""
        rng = random.Random(f"{self.seed}/{step}/{micro}")
        return [self._sample(rng) for _ in range(size)]

    def batch(
        self, step: int, micro: int, size: int, rank: int = 0, world: int = 1
    ) -> Seq2SeqBatch:
        return self.encode(self.pairs(step, micro, size)[rank::world])

    def encode(self, pairs: list[Pair]) -> Seq2SeqBatch:
        """Strings -> padded id tensors."""
        src = self.src_vocab.batch([s for s, _ in pairs])
        tgt = self.tgt_vocab.batch([t for _, t in pairs], bos=True, eos=True)
        return Seq2SeqBatch(src, tgt[:, :-1].masked_fill(tgt[:, :-1] == EOS, PAD), tgt[:, 1:])

    def count(self, batch: Seq2SeqBatch) -> int:
        return int((batch.tgt_out != PAD).sum())

    def loss(self, model: nn.Module, batch: Seq2SeqBatch) -> Tensor:
        logits = model(batch.src, batch.tgt_in)
        return label_smoothed_cross_entropy(
            logits, batch.tgt_out, smoothing=self.label_smoothing, ignore_index=PAD, reduction="sum"
        )

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Validation loss (no smoothing) and greedy exact match on the first ``eval_examples``."""
        pairs = self.valid[: self.eval_examples]
        device = next(model.parameters()).device
        total, tokens = 0.0, 0
        for i in range(0, len(pairs), 256):
            b = self.encode(pairs[i : i + 256]).to(device)
            logits = model(b.src, b.tgt_in)
            total += label_smoothed_cross_entropy(
                logits, b.tgt_out, ignore_index=PAD, reduction="sum"
            ).item()
            tokens += self.count(b)
        return {
            "valid_loss": total / max(tokens, 1),
            "valid_exact_match": exact_match(self, model, pairs),
        }

    def translate(
        self, model: nn.Module, texts: list[str], *, num_beams: int = 1, batch_size: int = 256
    ) -> list[str]:
        """Decode ``texts`` with greedy search (``num_beams=1``) or beam search, unchecked
        (for the task's own data; ``translate_checked`` for a user's inputs)."""
        return [self.tgt_vocab.decode(row) for row in self._generate(model, texts, num_beams,
                                                                      batch_size)]

    def translate_checked(
        self, model: nn.Module, texts: list[str], *, num_beams: int = 1, batch_size: int = 256
    ) -> list[Translation]:
        """One ``Translation`` per text, in order: the inputs that pass ``input_error`` are
        decoded together, and each output is checked (``output_error``)."""
        limit = model.config.max_len
        errors = [self.input_error(text, limit) for text in texts]
        good = [text for text, error in zip(texts, errors) if error is None]
        rows = iter(self._generate(model, good, num_beams, batch_size))
        results = []
        for text, error in zip(texts, errors):
            if error is not None:
                results.append(Translation(text, None, error))
                continue
            output, error = self._read(next(rows))
            error = error or self.output_error(output)
            results.append(Translation(text, None if error else output, error))
        return results

    def input_error(self, text: str, model_max_len: int) -> str | None:
        """Why ``text`` cannot be translated by a model that reads ``model_max_len`` positions,
        or None: empty, too long, characters outside the vocabulary, the task's own check."""
        if not text.strip():
            what = "only whitespace" if text else "empty input"
            return f"{what}; expected some text to translate"
        if len(text) > model_max_len:
            return f"{len(text)} characters, the model reads at most {model_max_len}"
        if self.max_input_len is not None and len(text) > self.max_input_len:
            return (f"{len(text)} characters, the model was trained on inputs of at most "
                    f"{self.max_input_len}")
        unknown = self.src_vocab.unknown(text)
        if unknown:
            return f"characters not in the model's vocabulary: {describe_characters(unknown)}"
        return self._input_check(text) if self._input_check else None

    def output_error(self, output: str) -> str | None:
        """Why a decoded ``output`` is not a valid answer of the task, or None."""
        if not output:
            return "the model's output is empty"
        return self._output_check(output) if self._output_check else None

    def _generate(
        self, model: nn.Module, texts: list[str], num_beams: int, batch_size: int
    ) -> list[list[int]]:
        """The generated ids of each text (``<bos>`` first)."""
        out: list[list[int]] = []
        model.eval()
        device = next(model.parameters()).device
        with torch.no_grad():
            for i in range(0, len(texts), batch_size):
                src = self.src_vocab.batch(texts[i : i + batch_size]).to(device)
                ids = generate_seq2seq(
                    model, src, self.max_target_len, bos_id=BOS, eos_id=EOS, num_beams=num_beams
                )
                out.extend(row.tolist() for row in ids)
        return out

    def _read(self, row: list[int]) -> tuple[str, str | None]:
        """The text of one generated row and why it is not a finished answer (a special
        token inside it, or no ``<eos>`` within ``max_target_len`` tokens), or None."""
        text, special = self.tgt_vocab.read(row[1:])
        if special == EOS:
            return text, None
        if special is not None:
            return text, f"the model produced {SPECIALS[special]} inside its output"
        return text, f"the model's output {text!r} did not end within {self.max_target_len} tokens"


def exact_match(
    task: Seq2SeqTask, model: nn.Module, pairs: list[Pair], *, num_beams: int = 1
) -> float:
    """Share of ``pairs`` whose decoded output equals the target exactly."""
    if not pairs:
        return 0.0
    hyps = task.translate(model, [s for s, _ in pairs], num_beams=num_beams)
    return sum(h == t for h, (_, t) in zip(hyps, pairs)) / len(pairs)


def make_seq2seq_task(
    name: str,
    *,
    seed: int = 0,
    max_len: int = 12,
    n_test: int = 2000,
    n_valid: int = 1000,
    label_smoothing: float = 0.1,
) -> Seq2SeqTask:
    """Build a task by name: one of ``SEQ2SEQ_TASKS``."""
    if name == "dates":
        return _dates_task(seed, n_valid, n_test, label_smoothing)
    makers = {
        "copy": lambda s: s,
        "reverse": lambda s: s[::-1],
        "sort": lambda s: "".join(sorted(s)),
    }
    if name in makers:
        fn = makers[name]

        def draw(rng: random.Random) -> Pair:
            s = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, max_len)))
            return s, fn(s)

        alphabet, longest, check = "0123456789", max_len, None
    elif name == "add":
        digits = max(1, max_len // 2)

        def draw(rng: random.Random) -> Pair:
            a, b = rng.randrange(10**digits), rng.randrange(10**digits)
            return f"{a}+{b}", str(a + b)

        def check(text: str) -> str | None:
            if re.fullmatch(rf"[0-9]{{1,{digits}}}\+[0-9]{{1,{digits}}}", text):
                return None
            return f"expected two numbers of 1 to {digits} digits joined by '+' (like 12+34)"

        alphabet, longest = "0123456789+", 2 * digits + 1
    else:
        raise ValueError(f"task: expected one of {SEQ2SEQ_TASKS}, got {name!r}")
    return _hashed_task(
        name,
        draw,
        alphabet,
        seed,
        n_valid,
        n_test,
        label_smoothing,
        max_input_len=longest,
        input_check=check,
        output_check=_digits_only,
    )


def _digits_only(text: str) -> str | None:
    # The add task's target vocabulary also holds '+'; every answer is a plain number.
    if text.isascii() and text.isdigit():
        return None
    return f"the model's output {text!r} is not a number"


def _hashed_task(
    name: str,
    draw: Callable[[random.Random], Pair],
    alphabet: str,
    seed: int,
    n_valid: int,
    n_test: int,
    label_smoothing: float,
    *,
    max_input_len: int,
    input_check: Check | None,
    output_check: Check,
) -> Seq2SeqTask:
    # A stable hash of the input puts each possible input in exactly one split.
    def split_of(src: str) -> int:
        return zlib.crc32(src.encode()) % 20

    def draw_split(rng: random.Random, which: set[int]) -> Pair:
        while True:
            pair = draw(rng)
            if split_of(pair[0]) in which:
                return pair

    rng = random.Random(f"{seed}/held-out")
    test = [draw_split(rng, {0}) for _ in range(n_test)]
    valid = [draw_split(rng, {1}) for _ in range(n_valid)]
    vocab = CharVocab(alphabet)
    return Seq2SeqTask(
        name,
        lambda r: draw_split(r, set(range(2, 20))),
        valid,
        test,
        vocab,
        vocab,
        seed=seed,
        label_smoothing=label_smoothing,
        max_input_len=max_input_len,
        input_check=input_check,
        output_check=output_check,
    )


def _dates_task(seed: int, n_valid: int, n_test: int, label_smoothing: float) -> Seq2SeqTask:
    splits = dates.split_dates(seed, n_valid=n_valid, n_test=n_test)
    rng = random.Random(f"{seed}/held-out")
    valid = dates.examples(splits.valid, rng)
    test = dates.examples(splits.test, rng)
    train = splits.train

    def draw(r: random.Random) -> Pair:
        return dates.examples([r.choice(train)], r)[0]

    return Seq2SeqTask(
        "dates",
        draw,
        valid,
        test,
        CharVocab(dates.all_characters()),
        CharVocab("0123456789-"),
        seed=seed,
        label_smoothing=label_smoothing,
        input_check=dates.input_error,
        output_check=dates.output_error,
    )
