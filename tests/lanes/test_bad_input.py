"""Bad input: every public entry point raises a typed error and changes nothing.

Each case runs against every store; the store's whole state (memory records, every Redis key's
``DUMP``, every SQL row) is compared before and after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.errors import BackendUnavailable, ClaimError, InvalidArgument, IoError
from celery_claims.lanes import (
    MAX_PROCESSING_TOKEN,
    InvalidValueError,
    LeaseLost,
    MemoryTaskClaimStore,
    TaskClaimCandidate,
    TaskCoreError,
    TaskLaneConfig,
    claim_due_for_lane,
)
from celery_claims.lanes.keys import escape
from celery_claims.lanes.redis import RedisTaskClaimStore
from celery_claims.lanes.sql import SqlTaskClaimStore
from tests.lanes.conftest import LANES, MAIL, REPORTS, T0, Harness, lane_of

LEASE = T0 + timedelta(seconds=30)
NAIVE = datetime(2030, 1, 1)


def cand(task_id: int = 1, expected: Any = 0, following: Any = 1, index: Any = 0) -> Any:
    return TaskClaimCandidate(index, task_id, expected, following)


def claim(lane: Any = MAIL, candidates: Any = None, window: Any = None) -> Callable[[Any], Any]:
    stale_before, claimed_at, lease = window or (T0, T0, LEASE)
    batch = [cand(1)] if candidates is None else candidates
    return lambda s: s.claim_candidates_for_lane(lane, batch, stale_before, claimed_at, lease)


#: (what is wrong, the call, the error it must raise, a fragment of the message)
CASES: list[tuple[str, Callable[[Any], Any], type[Exception], str]] = [
    # claim_candidates_for_lane
    ("unknown task id", claim(candidates=[cand(1), cand(404)]), InvalidValueError, "404"),
    ("task of another lane", claim(candidates=[cand(1), cand(3)]), InvalidValueError, "lane"),
    ("lane the store does not serve",
     claim(lane=TaskLaneConfig("mail", ("send_email",), 2)), InvalidValueError, "not a lane"),
    ("lane with foreign kinds",
     claim(lane=TaskLaneConfig("mail", ("send_email", "send_sms", "render"), 2)),
     InvalidValueError, "not a lane"),
    ("lane that is not a TaskLaneConfig", claim(lane={"lane": "mail"}), InvalidValueError, "lane"),
    ("string token", claim(candidates=[cand(1, "0", "1")]), InvalidValueError, "int"),
    ("float token", claim(candidates=[cand(1, 0.0, 1.0)]), InvalidValueError, "int"),
    ("bool token", claim(candidates=[cand(1, False, True)]), InvalidValueError, "int"),
    ("negative token", claim(candidates=[cand(1, -1, 0)]), InvalidValueError, "between"),
    ("token past 2**63-1",
     claim(candidates=[cand(1, MAX_PROCESSING_TOKEN, MAX_PROCESSING_TOKEN + 1)]),
     InvalidValueError, "between"),
    ("next token not above expected", claim(candidates=[cand(1, 0, 0)]), InvalidValueError,
     "greater"),
    ("negative index", claim(candidates=[cand(1, index=-1)]), InvalidValueError, "index"),
    ("candidate of the wrong type", claim(candidates=[(0, 1, 0, 1)]), InvalidValueError,
     "TaskClaimCandidate"),
    ("candidates not a sequence", claim(candidates="abc"), InvalidValueError, "sequence"),
    ("naive claimed_at", claim(window=(T0, NAIVE, LEASE)), InvalidValueError, "timezone-aware"),
    ("lease not after claimed_at", claim(window=(T0, T0, T0)), InvalidValueError, "after"),
    ("stale_before after claimed_at", claim(window=(LEASE, T0, LEASE)), InvalidValueError,
     "stale_before"),
    # listing and counting
    ("listing a kind of no lane",
     lambda s: s.list_claimable_by_kinds(T0, T0, ["nope"], 1), InvalidValueError, "no lane"),
    ("listing no kinds", lambda s: s.list_claimable_by_kinds(T0, T0, [], 1), InvalidValueError,
     "empty"),
    ("listing a bare string of kinds",
     lambda s: s.list_claimable_by_kinds(T0, T0, "send_email", 1), InvalidValueError, "sequence"),
    ("listing with a negative limit",
     lambda s: s.list_claimable_by_kinds(T0, T0, MAIL.kinds, -1), InvalidValueError, "limit"),
    ("listing with a bool limit",
     lambda s: s.list_claimable_by_kinds(T0, T0, MAIL.kinds, True), InvalidValueError, "limit"),
    ("listing at a naive time",
     lambda s: s.list_claimable_by_kinds(NAIVE, T0, MAIL.kinds, 1), InvalidValueError, "aware"),
    ("counting at a naive time",
     lambda s: s.count_active_processing_by_kinds(NAIVE, MAIL.kinds), InvalidValueError, "aware"),
    ("counting a kind of no lane",
     lambda s: s.count_active_processing_by_kinds(T0, ["nope"]), InvalidValueError, "no lane"),
    # enqueue
    ("enqueue of a taken id", lambda s: s.enqueue(1, "send_email", next_run_at=T0),
     InvalidValueError, "already exists"),
    ("enqueue of a taken id with another kind", lambda s: s.enqueue(1, "render", next_run_at=T0),
     InvalidValueError, "already exists"),
    ("enqueue of a kind of no lane", lambda s: s.enqueue(9, "nope", next_run_at=T0),
     InvalidValueError, "no lane"),
    ("enqueue of a negative id", lambda s: s.enqueue(-1, "send_email", next_run_at=T0),
     InvalidValueError, "task_id"),
    ("enqueue of a string id", lambda s: s.enqueue("9", "send_email", next_run_at=T0),
     InvalidValueError, "task_id"),
    ("enqueue of a bool id", lambda s: s.enqueue(True, "send_email", next_run_at=T0),
     InvalidValueError, "task_id"),
    ("enqueue at a naive time", lambda s: s.enqueue(9, "send_email", next_run_at=NAIVE),
     InvalidValueError, "aware"),
    ("enqueue of a bytes payload",
     lambda s: s.enqueue(9, "send_email", next_run_at=T0, payload=b"x"), InvalidValueError,
     "payload"),
    ("enqueue of a payload with NUL",
     lambda s: s.enqueue(9, "send_email", next_run_at=T0, payload="a\x00b"), InvalidValueError,
     "NUL"),
    ("enqueue of a payload with a lone surrogate",
     lambda s: s.enqueue(9, "send_email", next_run_at=T0, payload="\ud800"), InvalidValueError,
     "UTF-8"),
    # complete, retry, heartbeat
    ("complete of an unknown id", lambda s: s.complete(404, 1), InvalidValueError, "unknown"),
    ("complete with a string token", lambda s: s.complete(2, "1"), InvalidValueError, "int"),
    ("complete with a float token", lambda s: s.complete(2, 1.0), InvalidValueError, "int"),
    ("complete with a stale token", lambda s: s.complete(2, 0), LeaseLost, "claimed again"),
    ("complete of a task never claimed", lambda s: s.complete(1, 0), LeaseLost, "no longer"),
    ("retry with a stale token", lambda s: s.retry(2, 7, next_run_at=T0), LeaseLost, "task 2"),
    ("retry at a naive time", lambda s: s.retry(2, 1, next_run_at=NAIVE), InvalidValueError,
     "aware"),
    ("heartbeat of an unknown id", lambda s: s.heartbeat(404, 1, lease_expires_at=LEASE),
     InvalidValueError, "unknown"),
    ("heartbeat with a naive lease", lambda s: s.heartbeat(2, 1, lease_expires_at=NAIVE),
     InvalidValueError, "aware"),
    ("heartbeat with a bool token", lambda s: s.heartbeat(2, True, lease_expires_at=LEASE),
     InvalidValueError, "int"),
    # the algorithm over the store
    ("dispatch with a negative stale period",
     lambda s: claim_due_for_lane(s, MAIL, -5, lane_of), InvalidValueError, "stale"),
    ("dispatch for a lane the store does not serve",
     lambda s: claim_due_for_lane(s, TaskLaneConfig("mail", ("send_email",), 2), 5, lane_of,
                                  clock=lambda: T0 + timedelta(hours=1)),
     InvalidValueError, "not a lane"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "call", "error", "fragment"), CASES, ids=[case[0] for case in CASES]
)
def test_bad_input_raises_a_typed_error_and_changes_nothing(
    harness: Harness, case: str, call: Callable[[Any], Any], error: type[Exception], fragment: str
) -> None:
    # Given a pending mail task 1, a processing mail task 2 (token 1), a reports task 3
    harness.store.enqueue(1, "send_email", next_run_at=T0)
    harness.store.enqueue(2, "send_sms", next_run_at=T0 - timedelta(seconds=1))
    harness.store.claim_candidates_for_lane(
        MAIL, [cand(2)], T0 - timedelta(seconds=1), T0 - timedelta(seconds=1), LEASE
    )
    harness.store.enqueue(3, "render", next_run_at=T0)
    before = harness.snapshot()

    # When the bad call is made
    with pytest.raises(error, match=fragment) as raised:
        call(harness.store)

    # Then it is one of the package's typed errors, and the store is byte-for-byte unchanged
    assert isinstance(raised.value, TaskCoreError)
    assert isinstance(raised.value, ClaimError)
    assert harness.snapshot() == before


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"limit": -1}, "between 0"),
        ({"limit": 1.5}, "must be an int"),
        ({"limit": True}, "must be an int"),
        ({"limit": "3"}, "must be an int"),
        ({"kinds": ()}, "no kinds"),
        ({"kinds": "send_email"}, "tuple of kinds"),
        ({"kinds": ("a", "a")}, "twice"),
        ({"kinds": (["unhashable"],)}, "unhashable"),
        ({"fast_continue": "yes"}, "fast_continue"),
        ({"lock_key": 5}, "lock_key"),
        ({"lane": ["unhashable"]}, "hashable"),
    ],
)
def test_bad_lane_config_is_refused_on_construction(fields: dict[str, Any], fragment: str) -> None:
    values: dict[str, Any] = {"lane": "mail", "kinds": ("send_email",), "limit": 2, **fields}
    with pytest.raises(InvalidValueError, match=fragment):
        TaskLaneConfig(**values)


def test_lane_config_accepts_a_list_of_kinds_and_keeps_a_tuple() -> None:
    # A list where the annotation says tuple: accepted at run time, on purpose.
    lane: TaskLaneConfig[str, str] = TaskLaneConfig("mail", ["a", "b"], 1)  # type: ignore[arg-type]
    assert lane.kinds == ("a", "b")
    assert lane.lane_key == "mail"
    assert dataclasses.replace(lane, lock_key="mail-lock").lane_key == "mail-lock"


@pytest.mark.parametrize(
    ("lanes", "fragment"),
    [
        ([], "at least one lane"),
        ([MAIL, TaskLaneConfig("other", ("send_sms",), 1)], "two lanes"),
        ([MAIL, TaskLaneConfig("x", ("y",), 1, lock_key="mail")], "lane key"),
        ("mail", "iterable"),
        ([{"lane": "mail"}], "TaskLaneConfig"),
    ],
)
def test_store_with_overlapping_or_bad_lanes_is_refused(lanes: Any, fragment: str) -> None:
    with pytest.raises(InvalidValueError, match=fragment):
        MemoryTaskClaimStore(lanes=lanes)


def test_redis_and_sql_stores_need_string_kinds_and_exactly_one_connection() -> None:
    numeric = [TaskLaneConfig("mail", (1, 2), 1)]
    with pytest.raises(InvalidValueError, match="kind"):
        RedisTaskClaimStore(url="redis://127.0.0.1:1", lanes=numeric)
    with pytest.raises(InvalidValueError, match="exactly one"):
        RedisTaskClaimStore(lanes=LANES)
    with pytest.raises(InvalidValueError, match="braces"):
        RedisTaskClaimStore(url="redis://127.0.0.1:1", lanes=LANES, prefix="a{b}")
    with pytest.raises(InvalidValueError, match="Redis URL"):
        RedisTaskClaimStore(url="http://example.invalid", lanes=LANES)
    with pytest.raises(InvalidValueError, match="exactly one"):
        SqlTaskClaimStore(lanes=LANES)
    with pytest.raises(InvalidValueError, match="SQLAlchemy URL"):
        SqlTaskClaimStore(url="not a url", lanes=LANES)
    with pytest.raises(InvalidValueError, match="SQLAlchemy URL"):
        SqlTaskClaimStore(url="nosuchdialect://x", lanes=LANES)
    with pytest.raises(InvalidValueError, match="identifier"):
        SqlTaskClaimStore(url="sqlite://", lanes=LANES, table_prefix="x; drop")
    with pytest.raises(InvalidValueError, match="kind"):
        SqlTaskClaimStore(url="sqlite://", lanes=[TaskLaneConfig("m", ("k" * 256,), 1)])


def test_memory_store_accepts_any_hashable_kind() -> None:
    lane = TaskLaneConfig(lane=1, kinds=(("tuple", "kind"), 7), limit=1)
    store: MemoryTaskClaimStore[Any, int] = MemoryTaskClaimStore(lanes=[lane])
    store.enqueue(1, 7, next_run_at=T0)
    claimed = claim_due_for_lane(store, lane, 5, lambda kind: 1, clock=lambda: T0)
    assert [task.id for task, _ in claimed] == [1]


def test_key_escaping_is_reversible_and_hides_braces_and_colons() -> None:
    assert escape("a{b}:c%") == "a%7Bb%7D%3Ac%25"
    assert escape("a%7B") != escape("a{")
    assert REPORTS.lane_key == "reports"
    assert LANES[0] is MAIL


def test_one_except_catches_bad_input_and_one_an_unreachable_store_whichever_api() -> None:
    # Given a claim manager and a lane store on a port where no Redis listens
    claims = RedisClaimManager(url="redis://127.0.0.1:1")
    lanes = RedisTaskClaimStore(url="redis://127.0.0.1:1", lanes=LANES)
    try:
        # When each gets a bad argument, Then it raises InvalidArgument (the lanes' name for it
        # stays, as the same class)
        with pytest.raises(InvalidArgument):
            claims.claim("q", "", "w", 1000)
        with pytest.raises(InvalidArgument) as bad:
            lanes.enqueue(-1, "send_email", next_run_at=T0)
        assert isinstance(bad.value, InvalidValueError)
        assert bad.value.name == "task_id"

        # When each must reach its store, Then it raises BackendUnavailable
        with pytest.raises(BackendUnavailable):
            claims.claim("q", "t", "w", 1000)
        with pytest.raises(BackendUnavailable) as down:
            lanes.enqueue(1, "send_email", next_run_at=T0)
        assert isinstance(down.value, IoError)
    finally:
        claims.client.close()
        lanes.close()
