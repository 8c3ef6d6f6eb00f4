"""``MemoryRateLimiter``: the executable specification of fleet-wide rates.

The rule is the generic cell rate algorithm (GCRA) with no burst, in exact integers: each
limit keeps the theoretical time of its next start (TAT) as whole ms plus a remainder in
``1/count`` ms. A start at ``now`` (whole ms) is allowed when ``TAT < now + 1``; it is then
placed at ``max(TAT, now)`` and the TAT moves one interval (``period / count``) past it. So
the starts' places are an interval apart: any ``count + 1`` of them span a period, and no
window of a period holds more than ``count`` starts; and a start asked for as soon as it is
allowed is placed at the TAT itself, so a busy limit loses no fraction of a ms per start and
reaches ``count`` starts per period. Once ``now`` passes the TAT's ms, the state says no more
than its absence would: it is dropped (a Redis key expires then). ``lua/rate.lua`` is the same
rule, checked against this one by the contract suite.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from celery_claims.clock import Clock, system_clock_ms
from celery_claims.rates.model import (
    Limit,
    Rate,
    RateAllowed,
    RateLimited,
    RateResult,
    require_limits,
)
from celery_claims.validation import require_id

__all__ = ["MemoryRateLimiter", "TheoreticalTime", "next_time"]


@dataclass(frozen=True, slots=True)
class TheoreticalTime:
    """A limit's state: the time its next start is due, ``ms + remainder / count``.

    Attributes:
        ms: whole epoch ms (the floor); a start is allowed from this ms on.
        remainder: the fraction of a ms, in ``1/count`` ms (``0 <= remainder < count``).
        count: the rate's count the remainder is counted in (a limit whose rate changed
            converts it, rounding up: never earlier).
    """

    ms: int
    remainder: int
    count: int


def next_time(state: TheoreticalTime | None, rate: Rate, now_ms: int) -> TheoreticalTime:
    """The state after a start at ``now_ms`` that ``state`` allows (``state.ms <= now_ms``)."""
    if state is None or state.ms < now_ms:
        # the start is placed at now: nothing of an earlier TAT carries over
        ms, remainder = now_ms, 0
    else:
        ms, remainder = state.ms, state.remainder
        if state.count != rate.count:
            remainder = -(-remainder * rate.count // state.count)
    whole, fraction = rate.interval
    ms, remainder = ms + whole, remainder + fraction
    # a remainder of a converted count may reach count too, hence the loop-free divmod
    carry, remainder = divmod(remainder, rate.count)
    return TheoreticalTime(ms + carry, remainder, rate.count)


class MemoryRateLimiter:
    """Thread-safe in-process rate limiter with an injectable clock.

    Args:
        clock: returns epoch ms; the default reads ``time.time()`` (freezegun moves it).
    """

    def __init__(self, *, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or system_clock_ms
        self._lock = threading.Lock()
        self._states: dict[tuple[str, str], TheoreticalTime] = {}
        # (ms, scope, name) of each state written, soonest first: what to drop when
        self._expiry: list[tuple[int, str, str]] = []

    def acquire(self, scope: str, limits: Sequence[Limit]) -> RateResult:
        """See :meth:`celery_claims.rates.RateLimiter.acquire`."""
        require_id("scope", scope)
        checked = require_limits(limits)
        with self._lock:
            now = self._clock()
            self._drop_idle(now)
            states = [self._states.get((scope, limit.name)) for limit in checked]
            wait, longest = 0, ""
            for limit, state in zip(checked, states, strict=True):
                if state is not None and state.ms - now > wait:
                    wait, longest = state.ms - now, limit.name
            if wait:
                return RateLimited(now, wait, longest)
            # every limit allows the start: each counts it
            after = [
                next_time(state, limit.rate, now)
                for limit, state in zip(checked, states, strict=True)
            ]
            for limit, state in zip(checked, after, strict=True):
                self._states[scope, limit.name] = state
                heapq.heappush(self._expiry, (state.ms, scope, limit.name))
            return RateAllowed(now, tuple(state.ms for state in after))

    def _drop_idle(self, now: int) -> None:
        """Drop every state whose ms has passed (it allows what its absence allows)."""
        expiry = self._expiry
        while expiry and expiry[0][0] < now:
            ms, scope, name = heapq.heappop(expiry)
            state = self._states.get((scope, name))
            if state is not None and state.ms == ms:
                del self._states[scope, name]

    def stored(self) -> dict[tuple[str, str], TheoreticalTime]:
        """The states kept now, by ``(scope, name)`` (for tests: idle limits keep none)."""
        with self._lock:
            self._drop_idle(self._clock())
            return dict(self._states)
