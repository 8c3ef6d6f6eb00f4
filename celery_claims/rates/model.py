"""Value types of fleet-wide rates: the rate itself (Celery's spelling), a named limit, results.

A :class:`Rate` of ``count`` per ``period_ms`` allows at most ``count`` starts in any window of
``period_ms`` (half-open, in whole ms of the store's clock), spaced as Celery's own
``rate_limit`` spaces them (a token bucket of capacity 1): one every ``period_ms / count`` ms,
exactly, with no rounding drift, so a busy limit reaches ``count`` starts per period.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from celery_claims.errors import InvalidArgument
from celery_claims.validation import MAX_LEASE_MS, require_id

__all__ = [
    "MAX_LIMITS",
    "MAX_RATE_COUNT",
    "UNITS",
    "Limit",
    "Rate",
    "RateAllowed",
    "RateLimited",
    "RateResult",
    "RateStatus",
    "parse_rate",
    "require_limits",
]

#: Most starts per period a rate may allow: a sane bound that keeps the store's arithmetic
#: exact (a remainder times a count stays far below 2**53, where Lua's numbers are exact).
MAX_RATE_COUNT = 1_000_000

#: Longest period of a rate: the longest lease (a rate's key lives at most one interval).
MAX_PERIOD_MS = MAX_LEASE_MS

#: Most limits one start may be checked against at once (a task's, its lane's, its key's...).
MAX_LIMITS = 16

#: Celery's rate units (``celery.utils.time.RATE_MODIFIER_MAP``) and their length in ms.
UNITS = {"s": 1_000, "m": 60_000, "h": 3_600_000}

_NAMES = {ms: unit for unit, ms in UNITS.items()}
_COUNT = re.compile(r"[0-9]+")


class RateStatus(enum.IntEnum):
    """Status codes shared by ``rate.lua`` and the in-memory limiter.

    ``LIMITED`` is 9, a code ``claim.lua`` never answers (see
    :class:`celery_claims.model.ClaimStatus`), so a claim script that checks rates first can
    answer it unchanged.
    """

    ALLOWED = 1
    LIMITED = 9


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` starts in any window of ``period_ms``, one every ``period_ms / count``.

    Attributes:
        count: starts allowed per period (1 .. :data:`MAX_RATE_COUNT`).
        period_ms: the period (1 ms .. :data:`MAX_PERIOD_MS`).

    Raises:
        InvalidArgument: a count or period out of range (``name`` is ``rate.count`` or
            ``rate.period_ms``).
    """

    count: int
    period_ms: int

    def __post_init__(self) -> None:
        _require_whole("rate.count", self.count, 1, MAX_RATE_COUNT)
        _require_whole("rate.period_ms", self.period_ms, 1, MAX_PERIOD_MS)

    @property
    def interval(self) -> tuple[int, int]:
        """The emission interval ``period_ms / count`` as ``(whole ms, remainder in
        1/count ms)``: exact, so spacing by it never drifts."""
        return divmod(self.period_ms, self.count)

    def __str__(self) -> str:
        unit = _NAMES.get(self.period_ms)
        return f"{self.count}/{unit}" if unit else f"{self.count}/{self.period_ms}ms"


def _require_whole(name: str, value: Any, low: int, high: int) -> int:
    # bool is an int subclass: ``count=True`` is a bug, never one start
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an int, got {value!r:.80}")
    if not low <= value <= high:
        raise InvalidArgument(name, f"must be between {low} and {high}, got {value}")
    return value


def parse_rate(value: object, *, name: str) -> Rate:
    """Read a rate in Celery's spelling: ``"10/s"``, ``"10/m"``, ``"10/h"``, or ``"10"``
    (per second, as Celery reads a bare number). A :class:`Rate` is returned as is.

    Stricter than Celery's ``celery.utils.time.rate`` where its reading would surprise on a
    fleet-wide limit: the count is a whole number from 1 (Celery takes ``"0.5/s"``, and
    reads ``0`` as no limit at all), the unit is spelt out after a ``/`` (Celery reads
    ``"10/"`` as per second), and a number that is not a str is refused (Celery takes ``10``
    as ``"10/s"``). Blanks around either part are taken, as Celery's ``float()`` takes them
    around the count.

    Args:
        value: the rate as given.
        name: the setting or task attribute it was given as, for the error.

    Raises:
        InvalidArgument: anything else; its ``name`` is ``name``.
    """
    if isinstance(value, Rate):
        return value
    if not isinstance(value, str):
        hint = ""
        if isinstance(value, int) and not isinstance(value, bool):
            hint = f" (Celery's {value} per second is written '{value}/s')"
        raise InvalidArgument(
            name, f"must be a str like '10/s', '10/m' or '10/h', got {value!r:.80}{hint}"
        )
    text, slash, unit = value.partition("/")
    text, unit = text.strip(), unit.strip()
    if not _COUNT.fullmatch(text):
        raise InvalidArgument(
            name,
            f"must be a whole number of starts, '/' and a unit s, m or h (Celery's spelling, "
            f"e.g. '10/m'), got {value!r:.80}{_whole_hint(text, unit if slash else 's')}",
        )
    if slash and unit not in UNITS:
        raise InvalidArgument(name, f"unit must be s, m or h, got {unit!r:.20} in {value!r:.80}")
    count = int(text)
    if count < 1:
        raise InvalidArgument(
            name,
            f"must allow at least 1 start per period, got {value!r:.80}; for no limit, leave "
            f"the rate unset",
        )
    if count > MAX_RATE_COUNT:
        raise InvalidArgument(
            name, f"must allow at most {MAX_RATE_COUNT} starts per period, got {value!r:.80}"
        )
    return Rate(count, UNITS[unit] if slash else UNITS["s"])


def _whole_hint(text: str, unit: str) -> str:
    """``' ('0.5/s' is '30/m')'`` for a fraction that is whole over a longer unit, else ''."""
    try:
        number = float(text)
    except ValueError:
        return ""
    if unit not in UNITS or not math.isfinite(number) or number <= 0 or number.is_integer():
        return ""
    for longer, ms in UNITS.items():
        whole = number * ms / UNITS[unit]
        if ms > UNITS[unit] and whole == int(whole) and whole <= MAX_RATE_COUNT:
            return f" ('{text}/{unit}' is '{int(whole)}/{longer}')"
    return ""


@dataclass(frozen=True, slots=True)
class Limit:
    """One rate a start is checked against, and the name its state is kept under.

    Attributes:
        name: the limit's name within its scope (e.g. ``task:proj.send``,
            ``key:emails:customer-42``); any non-empty str, escaped before it goes in a key.
        rate: the rate.
    """

    name: str
    rate: Rate


def require_limits(limits: object) -> list[Limit]:
    """Return ``limits`` as a list if it is a sequence of 1 .. :data:`MAX_LIMITS` limits with
    usable, distinct names, else raise :class:`InvalidArgument` (``name`` is ``limits``)."""
    if isinstance(limits, (str, bytes)) or not isinstance(limits, Sequence):
        raise InvalidArgument("limits", f"must be a sequence of Limit, got {limits!r:.80}")
    checked = list(limits)
    if not 1 <= len(checked) <= MAX_LIMITS:
        raise InvalidArgument("limits", f"must hold 1..{MAX_LIMITS} limits, got {len(checked)}")
    names: set[str] = set()
    for limit in checked:
        if not isinstance(limit, Limit) or not isinstance(limit.rate, Rate):
            raise InvalidArgument("limits", f"must hold Limit values, got {limit!r:.80}")
        require_id("limits", limit.name)
        if limit.name in names:
            # the store would count one start twice against one key
            raise InvalidArgument("limits", f"names {limit.name!r:.80} twice")
        names.add(limit.name)
    return checked


@dataclass(frozen=True, slots=True)
class RateAllowed:
    """Every limit allowed the start, and each counted it.

    Attributes:
        at_ms: the store's time of the start (epoch ms).
        next_at_ms: for each limit, in the order given, the epoch ms from which its next
            start is allowed (``at_ms`` itself when another start fits in the same ms).
    """

    at_ms: int
    next_at_ms: tuple[int, ...]

    @property
    def allowed(self) -> Literal[True]:
        """Always true: the start may go."""
        return True


@dataclass(frozen=True, slots=True)
class RateLimited:
    """A limit refused the start; nothing was counted against any limit.

    Attributes:
        at_ms: the store's time of the refusal (epoch ms).
        retry_after_ms: how long until every limit allows a start (> 0), in the store's
            clock: a copy held for it is checked again then, not polled.
        limit: the name of the limit that waits longest.
    """

    at_ms: int
    retry_after_ms: int
    limit: str

    @property
    def allowed(self) -> Literal[False]:
        """Always false: the start must wait."""
        return False

    @property
    def retry_at_ms(self) -> int:
        """The store's epoch ms from which every limit allows a start."""
        return self.at_ms + self.retry_after_ms


#: The outcome of :meth:`celery_claims.rates.RateLimiter.acquire`.
RateResult: TypeAlias = RateAllowed | RateLimited
