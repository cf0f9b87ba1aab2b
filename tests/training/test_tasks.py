import datetime as dt
import random
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab.models.transformer import Transformer, TransformerConfig
from attnlab.training.tasks import dates, seq2seq
from attnlab.training.tasks.seq2seq import Translation, make_seq2seq_task
from attnlab.training.tasks.vocab import BOS, EOS, PAD, UNK, CharVocab, describe_characters

DATES_TASK = make_seq2seq_task("dates", n_test=1, n_valid=1)


def test_at_least_25_formats_with_the_issue_examples():
    assert len(dates.FORMATS) >= 25
    d = dt.date(2026, 11, 21)
    forms = {t.format(**dates._fields(d)) for t, _ in dates.FORMATS}
    for example in [
        "21 November 2026",
        "Nov 21, 2026",
        "11/21/26",
        "2026年11月21日",
        "21.11.2026",
        "Saturday, the 21st of November 2026",
    ]:
        assert example in forms


def test_every_input_has_exactly_one_answer():
    # Render every date of 1900-2099 in every form (case-folded) and require that no text
    # stands for two dates.
    seen: dict[str, int] = {}
    for o in range(dates.FIRST.toordinal(), dates.LAST.toordinal() + 1):
        d = dt.date.fromordinal(o)
        fields = dates._fields(d)
        in_window = dates.TWO_DIGIT_WINDOW[0] <= d.year <= dates.TWO_DIGIT_WINDOW[1]
        for template, two_digit in dates.FORMATS:
            if two_digit and not in_window:
                continue
            text = template.format(**fields).lower()
            assert seen.setdefault(text, o) == o, f"{text!r} is two dates"


def test_rendering_respects_the_two_digit_window_and_ordinals():
    rng = random.Random(0)
    for year in (1900, 1949, 2050, 2099):
        for _ in range(300):
            text = dates.render(dt.date(year, 5, 1), rng)
            assert str(year) in text or "年" in text or str(year) in text.replace(" ", "")
    assert [dates._ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 31)] == [
        "1st",
        "2nd",
        "3rd",
        "4th",
        "11th",
        "12th",
        "13th",
        "21st",
        "22nd",
        "23rd",
        "31st",
    ]


def test_splits_are_disjoint_and_cover_every_date():
    s = dates.split_dates(0)
    train, valid, test = set(s.train), set(s.valid), set(s.test)
    assert len(test) == 2000 and len(valid) == 1000
    assert not (train & valid) and not (train & test) and not (valid & test)
    assert len(train | valid | test) == (dates.LAST - dates.FIRST).days + 1
    assert dates.split_dates(0) == s


def test_date_task_batches_are_pure_functions_of_the_step():
    task = make_seq2seq_task("dates", n_test=50, n_valid=20)
    a, b = task.batch(7, 0, 16), task.batch(7, 0, 16)
    assert (a.src == b.src).all() and (a.tgt_out == b.tgt_out).all()
    assert not (
        task.batch(8, 0, 16).src.shape == a.src.shape and (task.batch(8, 0, 16).src == a.src).all()
    )
    # shards of two ranks interleave into the one-process batch
    r0, r1 = task.pairs(7, 0, 16)[0::2], task.pairs(7, 0, 16)[1::2]
    assert task.pairs(7, 0, 16) == [p for pair in zip(r0, r1) for p in pair]
    assert (a.tgt_in[:, 0] == BOS).all()
    assert ((a.tgt_out == EOS).sum(1) == 1).all()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", task.tgt_vocab.decode(a.tgt_out[0].tolist()))
    test_dates = {t for _, t in task.test}
    train_dates = {t for _, t in task.pairs(1, 0, 2000)}
    assert not test_dates & train_dates


@pytest.mark.parametrize(
    ("name", "check"),
    [
        ("copy", lambda s, t: s == t),
        ("reverse", lambda s, t: s[::-1] == t),
        ("sort", lambda s, t: "".join(sorted(s)) == t),
        ("add", lambda s, t: sum(int(x) for x in s.split("+")) == int(t)),
    ],
)
def test_synthetic_tasks(name, check):
    task = make_seq2seq_task(name, n_test=100, n_valid=50)
    train = task.pairs(0, 0, 300)
    assert all(check(s, t) for s, t in train + task.test + task.valid)
    assert not {s for s, _ in task.test} & {s for s, _ in train}


def test_vocab_round_trip_and_padding():
    v = CharVocab.from_texts(["hello", "world"])
    assert v.decode(v.encode("hold", bos=True, eos=True)) == "hold"
    assert v.encode("?") == [3]
    batch = v.batch(["he", "world"])
    assert batch.shape == (2, 5) and (batch[0, 2:] == PAD).all()


def test_unknown_task():
    with pytest.raises(ValueError, match="task"):
        make_seq2seq_task("translate")


def test_every_date_form_writes_at_least_min_digits():
    d = dt.date(2001, 1, 1)  # single-digit day and month: the fewest digits
    fewest = min(sum(c.isdigit() for c in t.format(**dates._fields(d))) for t, _ in dates.FORMATS)
    assert fewest == dates.MIN_DIGITS
    assert dates.input_error("1 Jan 50") is None
    assert "2 digit(s)" in dates.input_error("21 nov")


@given(st.text(alphabet="0123456789-", max_size=12))
def test_date_output_error_agrees_with_datetime(text):
    try:
        d = dt.datetime.strptime(text, "%Y-%m-%d").date()
        valid = d.isoformat() == text and dates.FIRST <= d <= dates.LAST
    except ValueError:
        valid = False
    assert (dates.output_error(text) is None) == valid


@given(st.dates(min_value=dates.FIRST, max_value=dates.LAST))
def test_every_date_of_the_task_is_a_valid_output(d):
    assert dates.output_error(d.isoformat()) is None


class FixedOutputs:
    """A stand-in for ``generate_seq2seq`` that answers each source with the given ids."""

    def __init__(self, task, outputs):
        self.task, self.outputs, self.calls = task, outputs, []

    def __call__(self, model, src, max_new_tokens, *, bos_id, eos_id, num_beams=1):
        texts = [self.task.src_vocab.decode(row) for row in src.tolist()]
        self.calls.append(texts)
        rows = [[bos_id, *self.outputs[t]] for t in texts]
        width = max(len(r) for r in rows)
        return torch.tensor([r + [PAD] * (width - len(r)) for r in rows])


def tiny_transformer(task, max_len=16):
    config = TransformerConfig(len(task.src_vocab), len(task.tgt_vocab), d_model=8, num_heads=2,
                               num_encoder_layers=1, num_decoder_layers=1, d_ff=16, dropout=0.0,
                               max_len=max_len)
    return Transformer(config)


def test_translate_checked_decodes_only_good_inputs_and_reads_outputs_strictly(monkeypatch):
    task = make_seq2seq_task("copy", max_len=6, n_test=5, n_valid=5)
    ids = task.tgt_vocab.encode
    fake = FixedOutputs(task, {
        "123": [*ids("123"), EOS],
        "45": [*ids("4"), UNK, *ids("5"), EOS],
        "678": ids("6" * 8),  # never ends
        "9": [EOS],
    })
    monkeypatch.setattr(seq2seq, "generate_seq2seq", fake)
    texts = ["123", "1234567", "12a", "45", "678", "9", ""]
    results = task.translate_checked(tiny_transformer(task), texts)
    assert fake.calls == [["123", "45", "678", "9"]]  # one batch, bad inputs never decoded
    assert [r.source for r in results] == texts
    assert results[0] == Translation("123", "123", None)
    assert [r.error for r in results[1:]] == [
        "7 characters, the model was trained on inputs of at most 6",
        "characters not in the model's vocabulary: 'a' (U+0061)",
        "the model produced <unk> inside its output",
        "the model's output '66666666' did not end within 8 tokens",
        "the model's output is empty",
        "empty input; expected some text to translate",
    ]
    assert all(r.output is None for r in results[1:])


def test_input_longer_than_the_model_reads_is_refused_before_the_task_limit():
    task = make_seq2seq_task("dates", n_test=1, n_valid=1)
    assert task.input_error("1" * 40, 32) == "40 characters, the model reads at most 32"
    assert task.input_error("21 November 2026", 32) is None
    assert task.input_error("1.1.2000".ljust(32), 32) is None
    assert task.input_error("1.1.2000".ljust(33), 32) == "33 characters, the model reads at most 32"
    assert task.max_input_len is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("12+34", None),
        ("1+2", None),
        ("12+", "expected two numbers of 1 to 2 digits joined by '+' (like 12+34)"),
        ("1+2+3", "expected two numbers of 1 to 2 digits joined by '+' (like 12+34)"),
        ("123+4", "expected two numbers of 1 to 2 digits joined by '+' (like 12+34)"),
        ("12345+6", "7 characters, the model was trained on inputs of at most 5"),
    ],
)
def test_add_task_input_checks(text, error):
    task = make_seq2seq_task("add", max_len=4, n_test=5, n_valid=5)
    assert task.input_error(text, 128) == error


def test_add_task_refuses_an_output_that_is_not_a_number():
    task = make_seq2seq_task("add", max_len=4, n_test=5, n_valid=5)
    assert task.output_error("12+3") == "the model's output '12+3' is not a number"
    assert task.output_error("123") is None


@given(st.text(max_size=40))
def test_input_error_never_raises_and_accepts_exactly_readable_inputs(text):
    task = DATES_TASK
    error = task.input_error(text, 30)
    readable = (bool(text.strip()) and len(text) <= 30
                and set(text) <= set(task.src_vocab.chars)
                and sum(c in "0123456789" for c in text) >= dates.MIN_DIGITS)
    assert (error is None) == readable


def test_vocab_read_stops_at_any_special_token_and_names_unknown_characters():
    v = CharVocab("abc")
    assert v.read(v.encode("abca")) == ("abca", None)
    assert v.read([*v.encode("ab"), UNK, *v.encode("c")]) == ("ab", UNK)
    assert v.read([EOS]) == ("", EOS)
    assert v.unknown("a€bx€y") == "€xy"
    assert describe_characters("€\t") == "'€' (U+20AC), '\\t' (U+0009)"
    assert describe_characters("abcdefghijkl").endswith("'j' (U+006A) and 2 more")
