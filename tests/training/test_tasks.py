import datetime as dt
import random
import re

import pytest

from attnlab.training.tasks import dates
from attnlab.training.tasks.seq2seq import make_seq2seq_task
from attnlab.training.tasks.vocab import BOS, EOS, PAD, CharVocab


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
