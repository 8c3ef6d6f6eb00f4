"""The rate spelling: Celery's ``"10/s"``, ``"10/m"``, ``"10/h"`` (and its bare ``"10"``, per
second) parsed into a :class:`Rate`; everything else refused, naming the setting."""

from __future__ import annotations

from typing import Any

import pytest

from celery_claims.errors import InvalidArgument
from celery_claims.rates import MAX_RATE_COUNT, Rate, parse_rate

GOOD: list[tuple[str, int, int]] = [
    ("10/s", 10, 1_000),
    ("10/m", 10, 60_000),
    ("10/h", 10, 3_600_000),
    ("1/s", 1, 1_000),
    # Celery's bare number is per second (celery.utils.time.rate: the modifier defaults to 's')
    ("10", 10, 1_000),
    # Celery's float() takes blanks around the number; so does this parser, around either part
    (" 10/s ", 10, 1_000),
    ("10 / m", 10, 60_000),
    (f"{MAX_RATE_COUNT}/s", MAX_RATE_COUNT, 1_000),
]


@pytest.mark.parametrize(("text", "count", "period_ms"), GOOD, ids=[g[0] for g in GOOD])
def test_a_rate_in_celerys_spelling_parses_into_its_count_and_period(
    text: str, count: int, period_ms: int
) -> None:
    rate = parse_rate(text, name="rate")
    assert rate == Rate(count, period_ms)
    assert (rate.count, rate.period_ms) == (count, period_ms)


BAD: list[tuple[Any, str]] = [
    ("10/x", "unit must be s, m or h"),
    ("10/S", "unit must be s, m or h"),
    ("10/sec", "unit must be s, m or h"),
    # Celery reads an empty unit as seconds; here it is a typo, refused
    ("10/", "unit must be s, m or h"),
    ("-1/s", "whole number"),
    ("+1/s", "whole number"),
    # Celery takes 0 as "no limit": a fleet-wide rate of 0 would never start a task
    ("0/s", "at least 1"),
    ("0", "at least 1"),
    # Celery takes fractions ('0.5/s'); a count of starts is whole here
    ("0.5/s", "whole number"),
    ("1e3/s", "whole number"),
    ("inf/s", "whole number"),
    ("nan", "whole number"),
    ("abc", "whole number"),
    ("", "whole number"),
    ("/s", "whole number"),
    ("10/s/m", "unit must be s, m or h"),
    ("\u0661\u0660/s", "whole number"),  # Arabic-Indic digits: int() would take them
    (f"{MAX_RATE_COUNT + 1}/s", f"at most {MAX_RATE_COUNT}"),
    # not a str: Celery takes a number as per second; here it must be spelt out
    (10, "'10/s'"),
    (0.5, "must be a str"),
    (True, "must be a str"),
    (None, "must be a str"),
    (b"10/s", "must be a str"),
    (["10/s"], "must be a str"),
]


@pytest.mark.parametrize(("value", "message"), BAD, ids=[repr(b[0]) for b in BAD])
def test_a_bad_rate_is_refused_naming_the_setting(value: Any, message: str) -> None:
    with pytest.raises(InvalidArgument, match="claims_rate") as raised:
        parse_rate(value, name="claims_rate")
    assert raised.value.name == "claims_rate"
    assert message in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_a_rate_passes_through_and_prints_in_celerys_spelling() -> None:
    rate = Rate(10, 60_000)
    assert parse_rate(rate, name="rate") is rate
    assert str(rate) == "10/m"
    assert str(Rate(3, 1_000)) == "3/s"
    assert str(Rate(2, 3_600_000)) == "2/h"
    # a period without a Celery unit prints in ms
    assert str(Rate(1, 1_500)) == "1/1500ms"
    assert parse_rate(str(Rate(7, 3_600_000)), name="rate") == Rate(7, 3_600_000)


@pytest.mark.parametrize(
    ("count", "period_ms", "field"),
    [
        (0, 1_000, "count"),
        (-1, 1_000, "count"),
        (True, 1_000, "count"),
        (1.0, 1_000, "count"),
        (MAX_RATE_COUNT + 1, 1_000, "count"),
        (1, 0, "period_ms"),
        (1, -5, "period_ms"),
        (1, 1.5, "period_ms"),
        (1, False, "period_ms"),
        (1, 31 * 24 * 3600 * 1000, "period_ms"),
    ],
)
def test_a_rate_made_directly_is_checked_too(count: Any, period_ms: Any, field: str) -> None:
    with pytest.raises(InvalidArgument, match=field) as raised:
        Rate(count, period_ms)
    assert raised.value.name == f"rate.{field}"


def test_the_emission_interval_is_exact_as_whole_ms_and_a_remainder_in_nths() -> None:
    # 3/s: one start every 333 1/3 ms
    assert Rate(3, 1_000).interval == (333, 1)
    assert Rate(10, 1_000).interval == (100, 0)
    # more starts than ms in the period: 0 whole ms and 1000/5000 of one
    assert Rate(5_000, 1_000).interval == (0, 1_000)
