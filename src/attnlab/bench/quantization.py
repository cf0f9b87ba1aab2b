"""Accuracy of quantized weights: float32, bfloat16, int8 and int4 on the same held-out data.

A character-level ``DecoderLM`` (Llama style: RoPE, RMSNorm, SwiGLU; hidden 128 and
feed-forward 384, which every int4 group size of 32, 64 and 128 divides) is trained here for
``--train-seconds`` on real English text: ``--text``, by default the GNU GPL version 3 that
every Debian system ships (``/usr/share/common-licenses/GPL-3``). Its last 10 % is held
out. For each copy of the trained weights (float32, bfloat16, int8 per output channel, int4
in groups of each ``--group-sizes`` along the input; int8/int4 activations in float32, and
int8 and int4 in groups of 64 once more with bfloat16 activations, the LM then
scored ``DECODING_ROWS`` positions a forward on a KV cache so that the decoding kernels run)
the benchmark reports, on every held-out character after the first:

    perplexity = exp(mean over positions of -log softmax(logits)[next character])
    agreement  = share of positions whose argmax equals float32's argmax
    KL         = mean over positions of KL(float32's next-character distribution || the copy's)

with the ratio of each to float32's, and the weight bytes (``weight_bytes``) against float32.
The date translator of ``attnlab demo`` is trained for ``--date-seconds`` and its greedy
exact match on held-out dates is reported for the same copies. Writes
``quantization-accuracy.md`` (``python -m devbench quantization`` keeps a committed table's
earlier runs below it) and prints PASS/FAIL for the issue's targets: int8 perplexity within
1 % of float32's, int4 with groups of 64 within 5 %.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab._checks import check_positive, is_int, is_number
from attnlab.arg_types import number, positive_float, positive_int
from attnlab.bench.harness import int_list, machine_info
from attnlab.bench.quantization_model import run_on_model
from attnlab.bench.quantization_report import DECODING_ROWS, targets, write_report
from attnlab.bench.timed_training import Training, train_for
from attnlab.models.decoder import DecoderLM, DecoderLMConfig
from attnlab.models.hf_loading import SUPPORTED_DTYPES
from attnlab.models.pretrained import cast_weights
from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.quantization import quantize_model, weight_bytes
from attnlab.training.tasks.seq2seq import Seq2SeqTask, make_seq2seq_task
from attnlab.training.tasks.text import CharLMTask, read_text
from attnlab.training.trainer import TrainConfig

__all__ = ["DEFAULT_TEXT", "AccuracyResult", "AccuracySettings", "DateResult", "DateScore",
           "LMResult", "LMScore", "Variant", "add_arguments", "check_group_sizes",
           "date_model_config", "lm_scores", "measure_accuracy", "measure_dates", "measure_lm",
           "run", "settings_from_args", "variants", "weights_as"]

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
HELD_OUT = 0.1
WEIGHTS = ("float32", "bfloat16", "int8", "int4")
# Held-out dates at most: the other ~63,000 days of 1900-2099 stay for training.
MAX_DATE_EXAMPLES = 10_000
MAX_SEED = 2**63  # torch.manual_seed's range
# The date translator's training, as ``attnlab demo`` trains it (``attnlab.cli.demo`` is a layer
# above the benchmarks), on half its batch: twice the steps in the same time.
DATE_TRAINING = TrainConfig(batch_size=64, lr=2e-3, warmup=100)
# ``--quick``: a smoke run of seconds (the size options are ignored).
QUICK = {"train_seconds": 2.0, "steps": 30, "layers": 1, "heads": 2, "block_size": 32,
         "batch_size": 8, "date_seconds": 2.0, "date_steps": 30, "date_examples": 50}


@dataclass(frozen=True)
class AccuracySettings:
    """What ``measure_accuracy`` trains and measures.

    The LM: ``d_model`` ``E`` (every group size must divide it), ``layers``, ``heads``,
    feed-forward ``3 E``, windows of ``block_size`` characters, ``batch_size`` windows a
    step, for ``train_seconds`` (the step count is that over the measured seconds a step
    takes, at most ``steps`` when given). The date model: ``attnlab demo``'s, trained for
    ``date_seconds`` (at most ``date_steps``), scored on ``date_examples`` held-out dates.
    Each run stops at its deadline even when the machine slows down during it.
    """

    text: Path = DEFAULT_TEXT
    train_seconds: float = 150.0
    steps: int | None = None
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    block_size: int = 64
    batch_size: int = 32
    group_sizes: tuple[int, ...] = (32, 64, 128)
    date_seconds: float = 120.0
    date_steps: int | None = None
    date_examples: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.text, (str, Path)):
            raise TypeError(f"text: expected a path (str or Path), got "
                            f"{type(self.text).__name__}")
        object.__setattr__(self, "text", Path(self.text))
        if not is_int(self.seed):
            raise TypeError(f"seed: expected an int, got {self.seed!r}")
        if not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed: expected an int in [0, 2**63), got {self.seed}")
        for name in ("train_seconds", "date_seconds"):
            value = getattr(self, name)
            if not is_number(value, finite=True) or value <= 0:
                raise ValueError(f"{name}: expected a finite number of seconds > 0, "
                                 f"got {value!r}")
        for name in ("d_model", "layers", "heads", "block_size", "batch_size", "date_examples"):
            check_positive(name, getattr(self, name))
        if self.date_examples > MAX_DATE_EXAMPLES:
            raise ValueError(f"date_examples: expected at most {MAX_DATE_EXAMPLES:,} (the "
                             f"other dates of 1900-2099 train the model), got "
                             f"{self.date_examples:,}")
        for name in ("steps", "date_steps"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        if self.d_model % self.heads:
            raise ValueError(f"d_model: expected a multiple of heads={self.heads}, "
                             f"got {self.d_model}")
        check_group_sizes(self.group_sizes, self.d_model)

    @property
    def d_ff(self) -> int:
        return 3 * self.d_model


@dataclass(frozen=True)
class Variant:
    """One copy of the weights: ``weights`` ``"float32"``, ``"bfloat16"``, ``"int8"`` or
    ``"int4"`` (with ``group_size``), computing in ``activations``: the weights' own dtype
    for float weights; float32 (default) or bfloat16 for int8 and int4."""

    weights: str
    group_size: int | None = None
    activations: str = ""

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights: expected one of {WEIGHTS}, got {self.weights!r}")
        if (self.weights == "int4") != (self.group_size is not None):
            raise ValueError(f"group_size: expected a group size for int4 weights and none "
                             f"for {self.weights}, got {self.group_size!r}")
        float_weights = self.weights in ("float32", "bfloat16")
        allowed = (self.weights,) if float_weights else ("float32", "bfloat16")
        if not self.activations:  # the default: the first allowed
            object.__setattr__(self, "activations", allowed[0])
        if self.activations not in allowed:
            raise ValueError(f"activations: expected one of {allowed} for {self.weights} "
                             f"weights, got {self.activations!r}")

    @property
    def label(self) -> str:
        return self.weights if self.group_size is None else f"{self.weights} g{self.group_size}"

    @property
    def decoding(self) -> bool:
        """Quantized weights with bfloat16 activations: scored as a decoder runs them, a few
        rows a forward (``DECODING_ROWS``), so that the kernels of decoding run."""
        return self.weights in ("int8", "int4") and self.activations == "bfloat16"


@dataclass(frozen=True)
class LMScore:
    """The LM with one variant's weights on the held-out text."""

    variant: Variant
    weight_bytes: int
    perplexity: float
    agreement: float
    kl: float = 0.0


@dataclass(frozen=True)
class DateScore:
    """The date model with one variant's weights: greedy exact match, and the share of its
    outputs equal to float32's."""

    variant: Variant
    exact_match: float
    same_as_float32: float


@dataclass(frozen=True)
class LMResult:
    """The character LM's part: ``model`` is the trained float32 LM and ``held_out`` the ids
    (``N``) it was scored on, so that a reader can check the figures."""

    text_chars: int
    text_sha256: str
    model: DecoderLM
    held_out: Tensor
    training: Training
    scores: tuple[LMScore, ...]


@dataclass(frozen=True)
class DateResult:
    """The date translator's part: ``model`` is the trained float32 translator, scored on
    ``examples`` held-out dates."""

    model: Transformer
    examples: int
    training: Training
    scores: tuple[DateScore, ...]


@dataclass(frozen=True)
class AccuracyResult:
    """Everything ``measure_accuracy`` measured, and the machine it ran on."""

    settings: AccuracySettings
    lm: LMResult
    dates: DateResult
    machine: dict[str, str] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``attnlab bench quantization``."""
    d = AccuracySettings()
    parser.add_argument("--text", type=Path, default=None,
                        help=f"UTF-8 English text to learn, its last 10%% held out (default "
                        f"{DEFAULT_TEXT}); with --model, the text to score (required)")
    parser.add_argument("--model", default=None,
                        help="a real model's float checkpoint folder: score quantized copies of "
                        "it against it instead (attnlab.bench.quantization_model)")
    parser.add_argument("--calibration", type=Path, default=None, metavar="FILE",
                        help="with --model: a text to calibrate GPTQ on (adds its rows)")
    parser.add_argument("--context", type=positive_int, default=512, metavar="N",
                        help="with --model: tokens per scored chunk (the second half scored)")
    parser.add_argument("--dtype", choices=sorted(SUPPORTED_DTYPES), default=None,
                        help="with --model: dtype of the reference (default: the stored one)")
    parser.add_argument("--train-seconds", type=positive_float, default=d.train_seconds,
                        help="training time of the character LM")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="most training steps of the LM (None: as many as "
                        "--train-seconds allows)")
    parser.add_argument("--d-model", type=positive_int, default=d.d_model,
                        help="hidden size E of the LM (every group size must divide it)")
    parser.add_argument("--layers", type=positive_int, default=d.layers, help="LM layers")
    parser.add_argument("--heads", type=positive_int, default=d.heads, help="LM heads")
    parser.add_argument("--block-size", type=positive_int, default=d.block_size,
                        help="characters per window, in training and scoring")
    parser.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                        help="windows per training step")
    parser.add_argument("--group-sizes", type=int_list,
                        default=",".join(map(str, d.group_sizes)),
                        help="comma-separated int4 group sizes")
    parser.add_argument("--date-seconds", type=positive_float, default=d.date_seconds,
                        help="training time of the date translator")
    parser.add_argument("--date-steps", type=positive_int, default=None,
                        help="most training steps of the date translator (None: as many as "
                        "--date-seconds allows)")
    parser.add_argument("--date-examples", default=d.date_examples,
                        type=number(int, lambda v: 1 <= v <= MAX_DATE_EXAMPLES,
                                    f"an int in [1, {MAX_DATE_EXAMPLES}]"),
                        help="held-out dates scored")
    parser.add_argument("--seed", default=d.seed, help="seed of data and weights",
                        type=number(int, lambda v: 0 <= v < MAX_SEED, "an int in [0, 2**63)"))


def run(args: argparse.Namespace) -> Path:
    """Run the benchmark, write ``quantization-accuracy.md`` into ``args.out``, print the
    table and PASS/FAIL per target; returns the markdown path."""
    if args.model is not None:
        return run_on_model(args)
    settings = settings_from_args(args)
    args.out.mkdir(parents=True, exist_ok=True)  # before minutes of training, not after
    result = measure_accuracy(settings, progress=True)
    path = write_report(result, args.out / "quantization-accuracy.md")
    print(path.read_text())
    for target in targets(result):
        print(f"{'PASS' if target.passed else 'FAIL'}: {target.describe()}")
    return path


def settings_from_args(args: argparse.Namespace) -> AccuracySettings:
    """The settings of the command line, refused by flag name where they do not fit."""
    args.text = args.text or DEFAULT_TEXT
    if not args.text.is_file():
        if args.text == DEFAULT_TEXT:
            raise ValueError(f"--text: the default {str(DEFAULT_TEXT)!r} is not on this "
                             "machine (Debian's base-files ships it); pass --text FILE, a "
                             "UTF-8 English text of some 30,000 characters or more")
        what = "is not a file" if args.text.exists() else "does not exist"
        raise ValueError(f"--text: {str(args.text)!r} {what}; expected a UTF-8 text file")
    check_group_sizes(args.group_sizes, args.d_model, name="--group-sizes",
                      width_name="--d-model")
    if args.d_model % args.heads:
        raise ValueError(f"--d-model: expected a multiple of --heads={args.heads}, "
                         f"got {args.d_model}")
    sizes = QUICK if args.quick else {}
    names = ("train_seconds", "steps", "d_model", "layers", "heads", "block_size",
             "batch_size", "group_sizes", "date_seconds", "date_steps", "date_examples", "seed")
    return AccuracySettings(text=args.text, **{n: sizes.get(n, getattr(args, n)) for n in names})


def check_group_sizes(group_sizes: object, d_model: int, *, name: str = "group_sizes",
                      width_name: str = "d_model") -> None:
    """Every int4 group size must divide every quantized layer's input: ``E`` and the
    feed-forward ``3 E`` (so dividing ``E`` is enough)."""
    if (not isinstance(group_sizes, tuple) or not group_sizes
            or not all(is_int(g) and g > 0 for g in group_sizes)
            or len(set(group_sizes)) != len(group_sizes)):
        raise ValueError(f"{name}: expected a non-empty tuple of positive ints, each once, "
                         f"got {group_sizes!r}")
    wrong = [g for g in group_sizes if d_model % g]
    if wrong:
        raise ValueError(f"{name}: int4 groups run along each layer's input, so every size "
                         f"must divide the hidden size {width_name}={d_model}; got "
                         f"{','.join(map(str, group_sizes))}, of which "
                         f"{','.join(map(str, wrong))} do not")


def measure_accuracy(settings: AccuracySettings, *, progress: bool = False) -> AccuracyResult:
    """Train the character LM and the date model as ``settings`` say, and score every
    variant of their weights on the same held-out data (module docstring)."""
    _check_settings(settings)
    return AccuracyResult(settings, measure_lm(settings, progress=progress),
                          measure_dates(settings, progress=progress), machine_info())


def measure_lm(settings: AccuracySettings, *, progress: bool = False) -> LMResult:
    """Train the character LM on ``settings.text`` and score every variant of its weights on
    the held-out text (``lm_scores``)."""
    _check_settings(settings)
    s = settings
    text = read_text(s.text)
    task = CharLMTask(text, block_size=s.block_size, seed=s.seed, valid_fraction=HELD_OUT)
    torch.manual_seed(s.seed)
    lm = DecoderLM(DecoderLMConfig.llama(
        len(task.vocab), d_model=s.d_model, num_layers=s.layers, num_heads=s.heads,
        d_ff=s.d_ff, dropout=0.1, max_len=s.block_size))
    config = TrainConfig(batch_size=s.batch_size, lr=3e-3, seed=s.seed)
    _say(progress, f"training the character LM on {s.text} for ~{s.train_seconds:g} s")
    training = train_for(lm, task, config, s.train_seconds, s.steps)
    scores = _score_lm(lm, task.valid_ids, s.block_size, s.group_sizes, progress)
    return LMResult(len(text), hashlib.sha256(text.encode("utf-8")).hexdigest(), lm.eval(),
                    task.valid_ids, training, scores)


def measure_dates(settings: AccuracySettings, *, progress: bool = False) -> DateResult:
    """Train the date translator and score every variant of its weights by greedy exact
    match on ``settings.date_examples`` held-out dates."""
    _check_settings(settings)
    s = settings
    dates = make_seq2seq_task("dates", seed=s.seed, n_valid=100, n_test=s.date_examples)
    torch.manual_seed(s.seed)
    translator = Transformer(date_model_config(dates))
    _say(progress, f"training the date translator for ~{s.date_seconds:g} s")
    training = train_for(translator, dates, replace(DATE_TRAINING, seed=s.seed), s.date_seconds,
                      s.date_steps)
    scores = _score_dates(translator, dates, s.group_sizes, progress)
    return DateResult(translator.eval(), len(dates.test), training, scores)


def lm_scores(model: nn.Module, ids: Tensor, window: int, *, rows: int | None = None,
              log_probs: bool = False) -> tuple[float, Tensor] | tuple[float, Tensor, Tensor]:
    """Perplexity of ``model`` on ``ids`` (``N``) and its argmax predictions (``N - 1``), and
    with ``log_probs`` its log-softmax at each of those positions (``N - 1 x V``, float32).

    ``ids`` is read in consecutive windows of ``window`` inputs, each predicting the next
    ``window`` ids, so that every id after the first is predicted once, from at most
    ``window`` ids before it: ``exp(mean -log softmax(logits)[target])`` over the ``N - 1``
    targets. Logits are scored in float32 whatever the model's dtype; ``model`` is put in
    eval mode. ``rows``: one window at a time, ``rows`` positions a forward on a KV cache
    (``model.make_cache``), as a decoder runs; the same logits in exact arithmetic.
    """
    if ids.dim() != 1 or len(ids) < 2:
        raise ValueError(f"ids: expected a 1-D tensor of at least 2 ids, got shape "
                         f"{tuple(ids.shape)}")
    check_positive("window", window)
    if rows is not None:
        check_positive("rows", rows)
    model.eval()
    total, predictions, logps = 0.0, [], []
    full = (len(ids) - 1) // window
    pieces = [(ids[: full * window].view(full, window),
               ids[1 : full * window + 1].view(full, window))]
    if (len(ids) - 1) % window:
        pieces.append((ids[full * window : -1][None], ids[full * window + 1 :][None]))
    with torch.no_grad():
        for inputs, targets in pieces:
            step = 64 if rows is None else 1  # 64 windows a forward bound the memory
            for start in range(0, len(inputs), step):
                x, y = inputs[start : start + step], targets[start : start + step]
                logits = (model(x) if rows is None else _cached_logits(model, x, rows)).float()
                total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum",
                                         ).double().item()
                predictions.append(logits.argmax(-1).flatten())
                if log_probs:
                    logps.append(F.log_softmax(logits, dim=-1).flatten(0, 1))
    scores = math.exp(total / (len(ids) - 1)), torch.cat(predictions)
    return (*scores, torch.cat(logps)) if log_probs else scores


def _cached_logits(model: nn.Module, x: Tensor, rows: int) -> Tensor:
    """``model(x)`` for ``x`` ``1 x L``, ``rows`` positions a forward on a KV cache."""
    cache = model.make_cache(1, x.shape[1])
    return torch.cat([model(x[:, i : i + rows], cache=cache)
                      for i in range(0, x.shape[1], rows)], dim=1)


def variants(group_sizes: tuple[int, ...]) -> tuple[Variant, ...]:
    """float32 first (the reference), bfloat16, int8, then int4 per group size, computing in
    float32; then int8 and int4 in groups of 64 (or the first group size) computing in
    bfloat16 (how ``python -m devbench qwen2 --quantize`` and a bfloat16 model decode)."""
    group = 64 if 64 in group_sizes else group_sizes[0]
    return (Variant("float32"), Variant("bfloat16"), Variant("int8"),
            *(Variant("int4", g) for g in group_sizes),
            Variant("int8", activations="bfloat16"), Variant("int4", group, activations="bfloat16"))


def weights_as(model: nn.Module, variant: Variant) -> nn.Module:
    """A copy of ``model`` (float32) with ``variant``'s weights and activation dtype; ``model``
    is untouched."""
    other = copy.deepcopy(model).eval()
    if variant.activations == "bfloat16":
        cast_weights(other, torch.bfloat16)
    if variant.weights in ("int8", "int4"):
        quantize_model(other, variant.weights, variant.group_size)
    return other


def date_model_config(task: Seq2SeqTask) -> TransformerConfig:
    """``attnlab demo``'s date translator: 2 + 2 Pre-LN layers, d=128, 8 heads, no dropout."""
    return TransformerConfig(
        src_vocab_size=len(task.src_vocab), tgt_vocab_size=len(task.tgt_vocab), d_model=128,
        num_heads=8, num_encoder_layers=2, num_decoder_layers=2, d_ff=512, dropout=0.0,
        norm_first=True, max_len=64)


def _check_settings(settings: object) -> None:
    if not isinstance(settings, AccuracySettings):
        raise TypeError(f"settings: expected AccuracySettings, got {type(settings).__name__}")


def _score_lm(lm: DecoderLM, held_out: Tensor, window: int, group_sizes: tuple[int, ...],
              progress: bool) -> tuple[LMScore, ...]:
    rows, reference, reference_logp = [], None, None
    for variant, model in _copies(lm, group_sizes, progress, "LM"):
        perplexity, predicted, logp = lm_scores(
            model, held_out, window, rows=DECODING_ROWS if variant.decoding else None,
            log_probs=True)
        if reference is None:
            reference, reference_logp = predicted, logp
        kl = (reference_logp.exp() * (reference_logp - logp)).sum(-1).mean().item()
        rows.append(LMScore(variant, weight_bytes(model), perplexity,
                            (predicted == reference).double().mean().item(), kl))
    return tuple(rows)


def _score_dates(model: Transformer, task: Seq2SeqTask, group_sizes: tuple[int, ...],
                 progress: bool) -> tuple[DateScore, ...]:
    sources = [s for s, _ in task.test]
    answers = [t for _, t in task.test]
    rows, reference = [], None
    for variant, copy_ in _copies(model, group_sizes, progress, "date model"):
        batch = DECODING_ROWS if variant.decoding else 256
        outputs = task.translate(copy_, sources, batch_size=batch)
        reference = outputs if reference is None else reference
        rows.append(DateScore(variant, _share(outputs, answers), _share(outputs, reference)))
    return tuple(rows)


def _copies(model: nn.Module, group_sizes: tuple[int, ...], progress: bool,
            what: str) -> Iterator[tuple[Variant, nn.Module]]:
    # One copy at a time: the quantized copies need not all be held together.
    model.eval()
    for variant in variants(group_sizes):
        _say(progress, f"scoring the {what} with {variant.label} weights")
        yield variant, weights_as(model, variant)


def _share(outputs: list[str], expected: list[str]) -> float:
    return sum(o == e for o, e in zip(outputs, expected)) / len(expected)


def _say(progress: bool, text: str) -> None:
    if progress:
        print(f"bench quantization: {text}", flush=True)
