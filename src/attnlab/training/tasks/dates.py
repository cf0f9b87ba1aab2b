"""Dates written by people -> ISO 8601: the data of the main job, generated, never downloaded.

A date between 1900-01-01 and 2099-12-31 is rendered in one of ``len(FORMATS)`` surface
forms (words, ordinals, weekdays, numeric, compact, Chinese), with random letter case; the
target is ``YYYY-MM-DD``. Every input has exactly one right answer:

- numeric forms follow one convention per separator: ``/`` is month-first (US:
  ``11/21/2026``, ``11/21/26``) or year-first (``2026/11/21``); ``.`` and ``-`` are
  day-first (``21.11.2026``, ``21.11.26``, ``21-11-2026``);
- two-digit years are used only inside the window 1950–2049 (``26`` is 2026, ``57`` is 1957).

Train, validation and test sets are disjoint in dates, drawn with a fixed seed.
"""

from __future__ import annotations

import datetime as dt
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "FIRST",
    "FORMATS",
    "LAST",
    "MIN_DIGITS",
    "TWO_DIGIT_WINDOW",
    "DateSplits",
    "input_error",
    "output_error",
    "render",
    "split_dates",
]

FIRST, LAST = dt.date(1900, 1, 1), dt.date(2099, 12, 31)
TWO_DIGIT_WINDOW = (1950, 2049)
# Every surface form writes at least the day and a two-digit year in digits ("1 Jan 50").
MIN_DIGITS = 3

_MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _fields(d: dt.date) -> dict[str, str]:
    return {
        "D": str(d.day),
        "DD": f"{d.day:02d}",
        "Dth": _ordinal(d.day),
        "M": str(d.month),
        "MM": f"{d.month:02d}",
        "Month": _MONTHS[d.month - 1],
        "Mon": _MONTHS[d.month - 1][:3],
        "YYYY": str(d.year),
        "YY": f"{d.year % 100:02d}",
        "Weekday": _DAYS[d.weekday()],
        "Wkd": _DAYS[d.weekday()][:3],
    }


# (template, uses a two-digit year). Templates use str.format fields from _fields.
FORMATS: tuple[tuple[str, bool], ...] = (
    ("{D} {Month} {YYYY}", False),
    ("{D} {Mon} {YYYY}", False),
    ("{Month} {D}, {YYYY}", False),
    ("{Mon} {D}, {YYYY}", False),
    ("{Mon}. {D}, {YYYY}", False),
    ("{Dth} {Month} {YYYY}", False),
    ("the {Dth} of {Month} {YYYY}", False),
    ("{Month} {Dth}, {YYYY}", False),
    ("{Month} the {Dth}, {YYYY}", False),
    ("{Weekday}, {D} {Month} {YYYY}", False),
    ("{Weekday} {D} {Month} {YYYY}", False),
    ("{Weekday}, {Month} {D}, {YYYY}", False),
    ("{Wkd}, {D} {Mon} {YYYY}", False),
    ("{Weekday}, the {Dth} of {Month} {YYYY}", False),
    ("{D}-{Mon}-{YYYY}", False),
    ("{D}/{Mon}/{YYYY}", False),
    ("{D}{Mon}{YYYY}", False),
    ("{MM}/{DD}/{YYYY}", False),
    ("{M}/{D}/{YY}", True),
    ("{YYYY}/{MM}/{DD}", False),
    ("{DD}.{MM}.{YYYY}", False),
    ("{D}.{M}.{YY}", True),
    ("{DD}-{MM}-{YYYY}", False),
    ("{YYYY}年{M}月{D}日", False),
    ("{YYYY}{MM}{DD}", False),
    ("{Mon} {Dth} '{YY}", True),
    ("{D} {Mon} {YY}", True),
)

_CASES: tuple[Callable[[str], str], ...] = (lambda s: s, str.lower, str.upper, str.title)


def render(d: dt.date, rng: random.Random) -> str:
    """One random surface form of ``d`` (two-digit years only inside ``TWO_DIGIT_WINDOW``)."""
    in_window = TWO_DIGIT_WINDOW[0] <= d.year <= TWO_DIGIT_WINDOW[1]
    while True:
        template, two_digit = rng.choice(FORMATS)
        if in_window or not two_digit:
            break
    text = template.format(**_fields(d))
    return rng.choice(_CASES)(text)


def input_error(text: str) -> str | None:
    """Why ``text`` cannot be one of the task's dates, or None when it may be one.

    A check that needs no model: every form writes the day and the year in digits, so a text
    with fewer than ``MIN_DIGITS`` digits (``"21 nov"``, ``"tomorrow"``) leaves the model to
    make up the rest.
    """
    digits = sum(c in "0123456789" for c in text)
    if digits < MIN_DIGITS:
        return (
            f"{digits} digit(s); a date needs its day and year in digits "
            f"(at least {MIN_DIGITS} digits)"
        )
    return None


def output_error(text: str) -> str | None:
    """Why the model's output ``text`` is not a valid answer, or None when it is one: a real
    calendar date (``datetime.date``) written ``YYYY-MM-DD`` between ``FIRST`` and ``LAST``."""
    if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text):
        return f"the model's output {text!r} is not a date written YYYY-MM-DD"
    try:
        d = dt.date.fromisoformat(text)
    except ValueError as error:
        return f"the model's output {text!r} is not a calendar date ({error})"
    if not FIRST <= d <= LAST:
        return f"the model's output {text!r} lies outside {FIRST}..{LAST}, the dates it knows"
    return None


def iso(d: dt.date) -> str:
    """The target: ``YYYY-MM-DD``."""
    return d.isoformat()


@dataclass(frozen=True)
class DateSplits:
    """Disjoint sets of dates (as ordinals) for training, validation and test."""

    train: tuple[int, ...]
    valid: tuple[int, ...]
    test: tuple[int, ...]


def split_dates(seed: int = 0, *, n_valid: int = 1000, n_test: int = 2000) -> DateSplits:
    """Shuffle every date of 1900–2099 with ``seed`` and cut it into three disjoint sets."""
    ordinals = list(range(FIRST.toordinal(), LAST.toordinal() + 1))
    if n_valid < 0 or n_test < 0 or n_valid + n_test >= len(ordinals):
        raise ValueError(f"n_valid, n_test: expected non-negative and together < {len(ordinals)}")
    random.Random(seed).shuffle(ordinals)
    return DateSplits(
        train=tuple(ordinals[n_valid + n_test :]),
        valid=tuple(ordinals[:n_valid]),
        test=tuple(ordinals[n_valid : n_valid + n_test]),
    )


def examples(ordinals: tuple[int, ...] | list[int], rng: random.Random) -> list[tuple[str, str]]:
    """``(human text, ISO)`` pairs, one random surface form per date."""
    out = []
    for o in ordinals:
        d = dt.date.fromordinal(o)
        out.append((render(d, rng), iso(d)))
    return out


def all_characters() -> str:
    """Every character that any rendering can produce (the source vocabulary)."""
    chars: set[str] = set()
    # 84 consecutive days cover every month/weekday name; digits come from the numeric forms.
    for o in range(dt.date(2001, 1, 1).toordinal(), dt.date(2001, 1, 1).toordinal() + 366, 3):
        fields = _fields(dt.date.fromordinal(o))
        for template, _ in FORMATS:
            text = template.format(**fields)
            for case in _CASES:
                chars.update(case(text))
    return "".join(sorted(chars | set("0123456789")))
