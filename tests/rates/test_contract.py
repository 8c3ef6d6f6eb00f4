"""The rate contract, the same for every limiter: no window of a period holds more than its
count of starts, a busy limit reaches its count per period, a refusal says exactly how long to
wait and costs nothing, several limits count a start all or none, idle limits keep nothing."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest

from celery_claims.errors import InvalidArgument
from celery_claims.rates import (
    MAX_LIMITS,
    Limit,
    Rate,
    RateAllowed,
    RateLimited,
    RateLimiter,
    parse_rate,
)
from celery_claims.testing import ManualClock
from tests.rates.conftest import Backend

SCOPE = "emails"


def limit(name: str, rate: str) -> Limit:
    return Limit(name, parse_rate(rate, name="rate"))


def busy(limiter: RateLimiter, clock: ManualClock, limits: list[Limit], span_ms: int) -> list[int]:
    """Start as often as allowed for ``span_ms``, asking again exactly when a refusal says;
    the start times."""
    end = clock() + span_ms
    starts = []
    while clock() < end:
        result = limiter.acquire(SCOPE, limits)
        if isinstance(result, RateAllowed):
            starts.append(result.at_ms)
        else:
            assert result.retry_after_ms > 0
            clock.advance(result.retry_after_ms)
    return starts


def assert_no_window_holds_more(starts: list[int], rate: Rate) -> None:
    """No half-open window of ``rate.period_ms`` holds more than ``rate.count`` starts: any
    ``count + 1`` consecutive starts span at least a period."""
    ordered = sorted(starts)
    for first, last in zip(ordered, ordered[rate.count :], strict=False):
        assert last - first >= rate.period_ms, (first, last, rate)


def test_every_limiter_is_a_rate_limiter(backend: Backend) -> None:
    assert isinstance(backend.limiter, RateLimiter)


def test_the_first_start_of_an_idle_limit_goes_at_once_and_says_when_the_next_may(
    backend: Backend,
) -> None:
    now = backend.clock()
    result = backend.limiter.acquire(SCOPE, [limit("task:send", "10/s")])
    assert result == RateAllowed(now, (now + 100,))
    assert result.allowed


def test_a_start_before_its_turn_is_refused_with_the_exact_wait(backend: Backend) -> None:
    # Given a start of a 10/s limit
    send = [limit("task:send", "10/s")]
    start = backend.clock()
    backend.limiter.acquire(SCOPE, send)

    # When the next is asked for 40 ms and 99 ms later, Then it waits exactly until 100 ms
    backend.clock.advance(40)
    assert backend.limiter.acquire(SCOPE, send) == RateLimited(start + 40, 60, "task:send")
    backend.clock.advance(59)
    refused = backend.limiter.acquire(SCOPE, send)
    assert refused == RateLimited(start + 99, 1, "task:send")
    assert not refused.allowed
    assert refused.retry_at_ms == start + 100
    # and at its time it goes
    backend.clock.advance(1)
    assert backend.limiter.acquire(SCOPE, send) == RateAllowed(start + 100, (start + 200,))


def test_refusals_cost_the_limit_nothing(backend: Backend) -> None:
    # Given a 1/s limit that just allowed a start
    once = [limit("task:report", "1/s")]
    start = backend.clock()
    backend.limiter.acquire(SCOPE, once)
    before = backend.snapshot()

    # When it is asked a hundred times before its turn
    refusals = {backend.limiter.acquire(SCOPE, once) for _ in range(100)}

    # Then each refusal is the same, nothing was written, and the start goes on time
    assert refusals == {RateLimited(start, 1_000, "task:report")}
    assert backend.snapshot() == before
    backend.clock.advance(1_000)
    assert backend.limiter.acquire(SCOPE, once).allowed


RATES = [
    # (rate, periods run)
    (Rate(1, 1_000), 10),
    (Rate(10, 1_000), 10),
    (Rate(3, 1_000), 10),  # 333 1/3 ms apart
    (Rate(7, 60_000), 10),
    (Rate(2, 3), 50),
    (Rate(3, 7), 50),
    # an interval just over a ms: rounding it to whole ms would halve the throughput
    (Rate(999, 1_000), 3),
    (Rate(1_000, 1_001), 3),
    # several starts in one ms
    (Rate(1_500, 1_000), 2),
]


@pytest.mark.parametrize(("rate", "periods"), RATES, ids=[f"{r[0]}x{r[1]}" for r in RATES])
def test_no_window_of_a_period_holds_more_than_its_count_and_a_busy_limit_reaches_it(
    backend: Backend, rate: Rate, periods: int
) -> None:
    # Given a limit asked again exactly when each refusal says, for a number of periods
    starts = busy(backend.limiter, backend.clock, [Limit("busy", rate)], periods * rate.period_ms)

    # Then no window of a period holds more than count starts, and the limit was not undershot:
    # it started count per period, to the start
    assert_no_window_holds_more(starts, rate)
    assert len(starts) == periods * rate.count


def test_a_start_is_counted_against_every_limit_or_against_none(backend: Backend) -> None:
    # Given a task limit (10/s) and a customer's key limit (1/s), both just used
    task, key = limit("task:charge", "10/s"), limit("key:charge:customer-7", "1/s")
    start = backend.clock()
    assert backend.limiter.acquire(SCOPE, [task, key]) == RateAllowed(
        start, (start + 100, start + 1_000)
    )

    # When the same customer's next charge comes 100 ms later
    backend.clock.advance(100)
    refused = backend.limiter.acquire(SCOPE, [task, key])

    # Then the key limit refuses it, and the task limit did not count it: another
    # customer's charge goes at once
    assert refused == RateLimited(start + 100, 900, "key:charge:customer-7")
    other = limit("key:charge:customer-8", "1/s")
    assert backend.limiter.acquire(SCOPE, [task, other]) == RateAllowed(
        start + 100, (start + 200, start + 1_100)
    )


def test_the_wait_is_the_longest_limits_and_names_it(backend: Backend) -> None:
    # Given three limits used at once
    fast, slow, medium = limit("a", "10/s"), limit("b", "2/s"), limit("c", "4/s")
    start = backend.clock()
    backend.limiter.acquire(SCOPE, [fast, slow, medium])

    # When another start is asked for at once, Then it waits for the slowest (the first of
    # the slowest, on a tie)
    assert backend.limiter.acquire(SCOPE, [fast, slow, medium]) == RateLimited(start, 500, "b")
    tie = limit("d", "2/s")
    backend.limiter.acquire(SCOPE, [tie])
    assert backend.limiter.acquire(SCOPE, [fast, tie, slow]) == RateLimited(start, 500, "d")


def test_limits_of_other_names_or_scopes_keep_their_own_state(backend: Backend) -> None:
    send = limit("task:send", "1/h")
    assert backend.limiter.acquire(SCOPE, [send]).allowed
    assert not backend.limiter.acquire(SCOPE, [send]).allowed
    # the same name in another scope, another name in the same scope: each has its own
    assert backend.limiter.acquire("reports", [send]).allowed
    assert backend.limiter.acquire(SCOPE, [limit("task:send2", "1/h")]).allowed
    # names that an unescaped key would confuse with hash tags or other keys
    for name in ("{emails}", "task:send:", "a}b{c", "%7B"):
        assert backend.limiter.acquire(SCOPE, [limit(name, "1/h")]).allowed, name


def test_a_limit_whose_rate_changes_keeps_its_turn_to_the_fraction(backend: Backend) -> None:
    # Given a 3/s limit that just started: its next turn is due at 333 1/3 ms
    start = backend.clock()
    assert backend.limiter.acquire(SCOPE, [limit("x", "3/s")]).allowed

    # When the rate becomes 2/s and a start comes at 333 ms
    backend.clock.advance(333)
    result = backend.limiter.acquire(SCOPE, [limit("x", "2/s")])

    # Then it goes (its turn's ms came), and the next is due 500 ms after 333 1/2 (1/3 in
    # halves, rounded up: never earlier): at 833 1/2, so from 833
    assert result == RateAllowed(start + 333, (start + 833,))
    # (and the one after at 1333 1/2)
    backend.clock.advance(500)
    assert backend.limiter.acquire(SCOPE, [limit("x", "2/s")]) == RateAllowed(
        start + 833, (start + 1_333,)
    )


def test_an_idle_limit_keeps_no_state(backend: Backend) -> None:
    # Given a thousand customers' limits of one start per 200 ms, each started once, on the
    # live clock (the server's, for Redis)
    live = backend.live
    limits = [limit(f"key:customer-{i}", "5/s") for i in range(1_000)]
    for one in limits:
        assert live.acquire(SCOPE, [one]).allowed
    assert backend.kept(live, SCOPE, limits[-5:]) == {one.name for one in limits[-5:]}

    # When nothing starts under them for longer than their interval
    time.sleep(0.5)

    # Then none of them is kept
    assert backend.kept(live, SCOPE, limits) == set()


BAD_LIMITS: list[Any] = [
    [],
    [limit(f"n{i}", "1/s") for i in range(MAX_LIMITS + 1)],
    [limit("same", "1/s"), limit("same", "2/s")],
    ["1/s"],
    [None],
    [Limit("", Rate(1, 1_000))],
    [Limit("nul\x00", Rate(1, 1_000))],
    [Limit(7, Rate(1, 1_000))],  # type: ignore[arg-type]
    [Limit("x", "1/s")],  # type: ignore[arg-type]
    limit("x", "1/s"),
    "abc",
    None,
]


@pytest.mark.parametrize("bad", BAD_LIMITS, ids=repr)
def test_bad_limits_are_refused_and_count_nothing(backend: Backend, bad: Any) -> None:
    backend.limiter.acquire(SCOPE, [limit("x", "1/s")])
    before = backend.snapshot()
    with pytest.raises(InvalidArgument, match="limits") as raised:
        backend.limiter.acquire(SCOPE, bad)
    assert raised.value.name == "limits"
    assert backend.snapshot() == before


@pytest.mark.parametrize("bad", ["", None, 3, b"emails", "nul\x00"], ids=repr)
def test_a_bad_scope_is_refused(backend: Backend, bad: Any) -> None:
    before = backend.snapshot()
    with pytest.raises(InvalidArgument, match="scope"):
        backend.limiter.acquire(bad, [limit("x", "1/s")])
    assert backend.snapshot() == before


@pytest.mark.parametrize("rate", [Rate(50, 1_000), Rate(3, 100)], ids=str)
def test_threads_hammering_one_limit_never_start_more_than_its_count_in_a_period(
    backend: Backend, rate: Rate
) -> None:
    # Given threads that each start as soon as the limit lets them, on the live clock, each
    # sleeping out its refusals (as a held copy would) or asking again at once
    live, one = backend.live, [Limit("hot", rate)]
    starts: list[int] = []
    errors: list[BaseException] = []
    deadline = time.monotonic() + 0.8

    def hammer(sleeps: bool) -> None:
        try:
            while time.monotonic() < deadline:
                result = live.acquire(SCOPE, one)
                if isinstance(result, RateAllowed):
                    starts.append(result.at_ms)  # list.append is atomic
                elif sleeps:
                    time.sleep(result.retry_after_ms / 1000)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i % 2 == 0,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Then the invariant held on the store's own times, and the limit was busy
    assert errors == []
    assert_no_window_holds_more(starts, rate)
    span = max(starts) - min(starts)
    assert len(starts) <= rate.count * (span // rate.period_ms + 1)
    assert len(starts) >= 0.5 * rate.count * 0.8 * 1000 / rate.period_ms
    assert math.isfinite(span)
