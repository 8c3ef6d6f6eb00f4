"""The generic algorithm, rule by rule, through a recording wrapper around the memory store."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from freezegun import freeze_time

from celery_claims.lanes import (
    MAX_PROCESSING_TOKEN,
    AsyncTaskClaimStore,
    ClaimedTask,
    InvalidValueError,
    MemoryTaskClaimStore,
    TaskClaimCandidate,
    TaskClaimStore,
    TaskLaneConfig,
    TaskLease,
    TaskRecord,
    ThreadedAsyncStore,
    aclaim_due_for_lane,
    claim_due_for_lane,
)
from tests.lanes.conftest import LANES, MAIL, T0, lane_of


class RecordingStore:
    """A memory store that records every protocol call, and can doctor what it returns."""

    def __init__(self) -> None:
        self.inner: MemoryTaskClaimStore[str, str] = MemoryTaskClaimStore(lanes=LANES)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.listing: list[Any] | None = None
        self.reverse_claims = False
        self.claims: list[ClaimedTask] | None = None

    def list_claimable_by_kinds(
        self, now: datetime, stale_before: datetime, kinds: Sequence[str], limit: int
    ) -> list[Any]:
        self.calls.append(("list", (now, stale_before, tuple(kinds), limit)))
        listed = self.inner.list_claimable_by_kinds(now, stale_before, kinds, limit)
        return listed if self.listing is None else self.listing

    def count_active_processing_by_kinds(self, now: datetime, kinds: Sequence[str]) -> int:
        self.calls.append(("count", (now, tuple(kinds))))
        return self.inner.count_active_processing_by_kinds(now, kinds)

    def claim_candidates_for_lane(
        self,
        lane_config: TaskLaneConfig[str, str],
        candidates: Sequence[TaskClaimCandidate],
        stale_before: datetime,
        claimed_at: datetime,
        lease_expires_at: datetime,
    ) -> list[ClaimedTask]:
        self.calls.append(
            ("claim", (lane_config, tuple(candidates), stale_before, claimed_at, lease_expires_at))
        )
        claimed = self.inner.claim_candidates_for_lane(
            lane_config, candidates, stale_before, claimed_at, lease_expires_at
        )
        if self.claims is not None:
            return self.claims
        return claimed[::-1] if self.reverse_claims else claimed

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def args(self, name: str) -> tuple[Any, ...]:
        return next(args for call, args in self.calls if call == name)


class AsyncRecordingStore:
    """A native asyncio store over :class:`RecordingStore`."""

    def __init__(self, store: RecordingStore) -> None:
        self.store = store

    async def list_claimable_by_kinds(self, *args: Any) -> list[Any]:
        return self.store.list_claimable_by_kinds(*args)

    async def count_active_processing_by_kinds(self, *args: Any) -> int:
        return self.store.count_active_processing_by_kinds(*args)

    async def claim_candidates_for_lane(self, *args: Any) -> list[ClaimedTask]:
        return self.store.claim_candidates_for_lane(*args)


def fixed(*times: datetime) -> Any:
    """A clock that returns ``times`` one after the other."""
    return iter(times).__next__


@pytest.fixture
def store() -> RecordingStore:
    return RecordingStore()


def test_the_shipped_stores_satisfy_the_protocols(store: RecordingStore) -> None:
    assert isinstance(store.inner, TaskClaimStore)
    assert isinstance(ThreadedAsyncStore(store.inner), AsyncTaskClaimStore)
    assert isinstance(AsyncRecordingStore(store), AsyncTaskClaimStore)


def test_lane_with_limit_zero_claims_nothing_without_calling_the_store(
    store: RecordingStore,
) -> None:
    # Given a due task and a paused lane (limit 0)
    store.inner.enqueue(1, "send_email", next_run_at=T0)

    # When the lane is claimed
    claimed = claim_due_for_lane(store, dataclasses.replace(MAIL, limit=0), 30, lane_of)

    # Then nothing is claimed and the store was never called
    assert claimed == []
    assert store.calls == []


def test_listing_uses_the_lane_limit_and_stale_before_is_now_minus_the_stale_period(
    store: RecordingStore,
) -> None:
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    claim_due_for_lane(store, dataclasses.replace(MAIL, limit=7), 45, lane_of, clock=fixed(T0, T0))
    assert store.args("list") == (T0, T0 - timedelta(seconds=45), MAIL.kinds, 7)
    assert store.args("count") == (T0, MAIL.kinds)


@pytest.mark.parametrize("stale_secs", [0, 1])
def test_stale_period_below_one_second_counts_as_one(
    store: RecordingStore, stale_secs: int
) -> None:
    # Given a due task
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    later = T0 + timedelta(seconds=3)

    # When the lane is claimed with a stale period of 0 or 1 s
    claim_due_for_lane(store, MAIL, stale_secs, lane_of, clock=fixed(T0, later))

    # Then both stale_before and the lease use 1 s
    _, _, stale_before, claimed_at, lease_expires_at = store.args("claim")
    assert stale_before == T0 - timedelta(seconds=1)
    assert (claimed_at, lease_expires_at) == (later, later + timedelta(seconds=1))


def test_claimed_at_is_a_second_clock_read_and_the_lease_follows_it(
    store: RecordingStore,
) -> None:
    # Given a clock that moves 2 s between the listing and the claim
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    claimed_at = T0 + timedelta(seconds=2)

    # When the lane is claimed with a 30 s stale period
    claimed = claim_due_for_lane(store, MAIL, 30, lane_of, clock=fixed(T0, claimed_at))

    # Then the store gets stale_before from the first read, claimed_at from the second
    _, _, stale_before, at, lease = store.args("claim")
    assert (stale_before, at, lease) == (
        T0 - timedelta(seconds=30),
        claimed_at,
        claimed_at + timedelta(seconds=30),
    )
    assert store.inner.get_task(1).lease_expires_at == claimed_at + timedelta(seconds=30)
    assert [lease for _, lease in claimed] == [TaskLease(1, 1)]


def test_empty_listing_stops_before_counting(store: RecordingStore) -> None:
    assert claim_due_for_lane(store, MAIL, 30, lane_of, clock=fixed(T0)) == []
    assert store.names() == ["list"]


def test_full_lane_stops_before_claiming(store: RecordingStore) -> None:
    # Given a lane of limit 1 whose only slot is held, and a due task
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    store.inner.enqueue(2, "send_email", next_run_at=T0)
    claim_due_for_lane(store, dataclasses.replace(MAIL, limit=1), 30, lane_of, clock=fixed(T0, T0))
    store.calls.clear()

    # When the lane is claimed again
    claimed = claim_due_for_lane(
        store, dataclasses.replace(MAIL, limit=1), 30, lane_of, clock=fixed(T0, T0)
    )

    # Then the store is listed and counted, but never asked to claim
    assert claimed == []
    assert store.names() == ["list", "count"]


def test_candidates_are_not_cut_to_the_available_capacity(store: RecordingStore) -> None:
    # Given a lane of limit 3 with 2 slots held and 3 due tasks
    lane = dataclasses.replace(MAIL, limit=3)
    for task_id in (1, 2):
        store.inner.enqueue(task_id, "send_email", next_run_at=T0 - timedelta(seconds=1))
    claim_due_for_lane(store, dataclasses.replace(MAIL, limit=2), 30, lane_of, clock=fixed(T0, T0))
    for task_id in (3, 4, 5):
        store.inner.enqueue(task_id, "send_sms", next_run_at=T0)
    store.calls.clear()

    # When the lane is claimed
    claimed = claim_due_for_lane(store, lane, 30, lane_of, clock=fixed(T0, T0))

    # Then all 3 listed tasks are candidates, and the store claims only the free slot's worth
    _, candidates, *_ = store.args("claim")
    assert [c.task_id for c in candidates] == [3, 4, 5]
    assert [task.id for task, _ in claimed] == [3]


def test_task_of_another_lane_is_skipped_with_a_warning_and_indices_keep_their_place(
    store: RecordingStore, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a listing whose middle task maps to another lane
    for task_id in (1, 2, 3):
        store.inner.enqueue(task_id, "send_email", next_run_at=T0 + timedelta(seconds=task_id))
    later = T0 + timedelta(seconds=5)

    listed = store.inner.list_claimable_by_kinds(later, later, MAIL.kinds, 3)
    store.listing = [listed[0], dataclasses.replace(listed[1], kind="render"), listed[2]]

    # When the lane is claimed
    with caplog.at_level(logging.WARNING, logger="celery_claims.lanes.dispatch"):
        claimed = claim_due_for_lane(
            store, dataclasses.replace(MAIL, limit=3), 30, lane_of, clock=fixed(later, later)
        )

    # Then the other lane's task is no candidate, and the others keep indices 0 and 2
    _, candidates, *_ = store.args("claim")
    assert candidates == (TaskClaimCandidate(0, 1, 0, 1), TaskClaimCandidate(2, 3, 0, 1))
    assert [(task.id, lease) for task, lease in claimed] == [
        (1, TaskLease(1, 1)),
        (3, TaskLease(3, 1)),
    ]
    assert "belongs to lane 'reports', not lane 'mail'" in caplog.text


def test_token_overflow_aborts_the_whole_pass_before_any_claim(store: RecordingStore) -> None:
    # Given a listing whose second task has the largest token
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    store.inner.enqueue(2, "send_email", next_run_at=T0)
    listed = store.inner.list_claimable_by_kinds(T0, T0, MAIL.kinds, 2)
    store.listing = [
        listed[0],
        dataclasses.replace(listed[1], processing_token=MAX_PROCESSING_TOKEN),
    ]
    before = store.inner.snapshot()

    # When the lane is claimed
    with pytest.raises(InvalidValueError) as error:
        claim_due_for_lane(store, MAIL, 30, lane_of, clock=fixed(T0, T0))

    # Then the original's error, no claim call, and not even the first task claimed
    assert str(error.value) == "background task processing token overflow"
    assert "claim" not in store.names()
    assert store.inner.snapshot() == before


def test_token_overflow_of_another_lanes_task_is_only_skipped(store: RecordingStore) -> None:
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    listed = store.inner.list_claimable_by_kinds(T0, T0, MAIL.kinds, 1)
    store.listing = [
        dataclasses.replace(listed[0], id=99, kind="render", processing_token=MAX_PROCESSING_TOKEN),
        listed[0],
    ]
    claimed = claim_due_for_lane(store, MAIL, 30, lane_of, clock=fixed(T0, T0))
    assert [(task.id, lease) for task, lease in claimed] == [(1, TaskLease(1, 1))]


def test_results_follow_the_stores_claim_order(store: RecordingStore) -> None:
    # Given a store that reports its claims in reverse order
    for task_id in (1, 2):
        store.inner.enqueue(task_id, "send_email", next_run_at=T0)
    store.reverse_claims = True

    # When the lane is claimed
    claimed = claim_due_for_lane(store, MAIL, 30, lane_of, clock=fixed(T0, T0))

    # Then each lease is paired with its listed task, in the store's order
    assert [(task.id, lease) for task, lease in claimed] == [
        (2, TaskLease(2, 1)),
        (1, TaskLease(1, 1)),
    ]
    assert all(task.processing_token == 0 for task, _ in claimed)


def test_claim_for_an_index_that_was_never_listed_is_refused(store: RecordingStore) -> None:
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    store.claims = [ClaimedTask(5, 1, 1)]
    with pytest.raises(InvalidValueError, match="matches no candidate"):
        claim_due_for_lane(store, MAIL, 30, lane_of, clock=fixed(T0, T0))


def test_default_clock_reads_utc_now_so_freezegun_moves_it(store: RecordingStore) -> None:
    # Given a due task and the wall clock frozen at T0 + 1 h
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    with freeze_time(T0 + timedelta(hours=1)):
        # When the lane is claimed with the default clock
        claimed = claim_due_for_lane(store, MAIL, 30, lane_of)

    # Then the frozen time is both now and claimed_at, in UTC
    now, *_ = store.args("list")
    _, _, _, claimed_at, lease = store.args("claim")
    assert now == claimed_at == T0 + timedelta(hours=1)
    assert now.tzinfo is not None
    assert lease == T0 + timedelta(hours=1, seconds=30)
    assert len(claimed) == 1


def test_expired_lease_is_reclaimed_as_frozen_time_moves_past_it(store: RecordingStore) -> None:
    # Given a task claimed at T0 with a 5 s stale period, never completed
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    with freeze_time(T0) as frozen:
        assert [lease for _, lease in claim_due_for_lane(store, MAIL, 5, lane_of)] == [
            TaskLease(1, 1)
        ]
        # When time moves to 1 µs before, then to, the lease's end
        frozen.tick(timedelta(seconds=5) - timedelta(microseconds=1))
        early = claim_due_for_lane(store, MAIL, 5, lane_of)
        frozen.tick(timedelta(microseconds=1))
        late = claim_due_for_lane(store, MAIL, 5, lane_of)

    # Then the task is taken over only once its lease has ended
    assert early == []
    assert [lease for _, lease in late] == [TaskLease(1, 2)]


def test_clock_in_another_zone_is_converted_to_utc(store: RecordingStore) -> None:
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    cet = timezone(timedelta(hours=1))
    local = T0.astimezone(cet)
    claim_due_for_lane(store, MAIL, 30, lane_of, clock=fixed(local, local))
    now, *_ = store.args("list")
    assert now == T0
    assert now.tzinfo == timezone.utc


def test_naive_clock_is_refused_before_any_store_call(store: RecordingStore) -> None:
    with pytest.raises(InvalidValueError, match="timezone-aware"):
        claim_due_for_lane(store, MAIL, 30, lane_of, clock=fixed(datetime(2030, 1, 1)))
    assert store.calls == []


@pytest.mark.parametrize("stale_secs", [-1, 1.5, "30", True, None, 2**31])
def test_bad_stale_period_is_refused_before_any_store_call(
    store: RecordingStore, stale_secs: Any
) -> None:
    with pytest.raises(InvalidValueError, match="processing_stale_secs"):
        claim_due_for_lane(store, MAIL, stale_secs, lane_of)
    assert store.calls == []


@pytest.mark.parametrize(
    ("lane_config", "task_lane", "match"),
    [
        ({"lane": "mail"}, lane_of, "TaskLaneConfig"),
        (MAIL, "mail", "task_lane must be callable"),
    ],
)
def test_bad_lane_or_task_lane_is_refused_before_any_store_call(
    store: RecordingStore, lane_config: Any, task_lane: Any, match: str
) -> None:
    with pytest.raises(InvalidValueError, match=match):
        claim_due_for_lane(store, lane_config, 30, task_lane)
    assert store.calls == []


# --- asyncio -------------------------------------------------------------------------------


def test_async_twin_follows_the_same_rules(store: RecordingStore) -> None:
    # Given 3 due tasks, a lane of limit 2, and a native asyncio store
    for task_id in (1, 2, 3):
        store.inner.enqueue(task_id, "send_email", next_run_at=T0)
    later = T0 + timedelta(seconds=1)

    # When the lane is claimed through the asyncio twin
    claimed = asyncio.run(
        aclaim_due_for_lane(AsyncRecordingStore(store), MAIL, 30, lane_of, clock=fixed(T0, later))
    )

    # Then the same calls, arguments and result as the sync algorithm
    assert store.names() == ["list", "count", "claim"]
    assert store.args("list") == (T0, T0 - timedelta(seconds=30), MAIL.kinds, 2)
    assert store.args("claim")[3:] == (later, later + timedelta(seconds=30))
    assert [(task.id, lease) for task, lease in claimed] == [
        (1, TaskLease(1, 1)),
        (2, TaskLease(2, 1)),
    ]


def test_async_twin_skips_the_store_for_a_paused_lane_and_aborts_on_overflow(
    store: RecordingStore,
) -> None:
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    paused = dataclasses.replace(MAIL, limit=0)
    assert asyncio.run(aclaim_due_for_lane(AsyncRecordingStore(store), paused, 30, lane_of)) == []
    assert store.calls == []

    listed = store.inner.list_claimable_by_kinds(T0, T0, MAIL.kinds, 1)
    store.listing = [dataclasses.replace(listed[0], processing_token=MAX_PROCESSING_TOKEN)]
    with pytest.raises(InvalidValueError, match="background task processing token overflow"):
        asyncio.run(
            aclaim_due_for_lane(AsyncRecordingStore(store), MAIL, 30, lane_of, clock=fixed(T0, T0))
        )
    assert "claim" not in store.names()


def test_threaded_adapter_runs_a_sync_store_under_asyncio() -> None:
    # Given a memory store with 2 due tasks, wrapped for asyncio
    inner: MemoryTaskClaimStore[str, str] = MemoryTaskClaimStore(lanes=LANES)
    inner.enqueue(1, "send_sms", next_run_at=T0)
    inner.enqueue(2, "render", next_run_at=T0)

    async def both() -> list[list[tuple[TaskRecord[str], TaskLease]]]:
        adapter = ThreadedAsyncStore(inner)
        clock = fixed(T0, T0, T0, T0)
        return list(
            await asyncio.gather(
                aclaim_due_for_lane(adapter, MAIL, 30, lane_of, clock=clock),
                aclaim_due_for_lane(adapter, LANES[1], 30, lane_of, clock=clock),
            )
        )

    # When both lanes are claimed concurrently
    mail, reports = asyncio.run(both())

    # Then each lane claims its own task
    assert [lease for _, lease in mail] == [TaskLease(1, 1)]
    assert [lease for _, lease in reports] == [TaskLease(2, 1)]


def test_listed_object_that_is_no_task_record_is_refused(store: RecordingStore) -> None:
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    store.listing = [object()]
    with pytest.raises(InvalidValueError, match="no id, kind or processing_token"):
        claim_due_for_lane(store, MAIL, 30, lane_of, clock=fixed(T0, T0))
    assert "claim" not in store.names()


def test_no_candidate_left_after_the_lane_check_returns_before_the_second_clock_read(
    store: RecordingStore,
) -> None:
    # Given a listing in which every task belongs to another lane
    store.inner.enqueue(1, "send_email", next_run_at=T0)
    store.inner.enqueue(2, "send_email", next_run_at=T0)
    listed = store.inner.list_claimable_by_kinds(T0, T0, MAIL.kinds, 2)
    store.listing = [dataclasses.replace(task, kind="render") for task in listed]
    reads: list[datetime] = []

    def clock() -> datetime:
        reads.append(T0)
        return T0

    # When the lane is claimed, synchronously and through the asyncio twin
    claimed = claim_due_for_lane(store, MAIL, 30, lane_of, clock=clock)
    claimed_async = asyncio.run(
        aclaim_due_for_lane(AsyncRecordingStore(store), MAIL, 30, lane_of, clock=clock)
    )

    # Then nothing is claimed, the clock was read once per pass (no claimed_at), and the
    # store was listed and counted but never asked to claim an empty candidate list
    assert claimed == []
    assert claimed_async == []
    assert len(reads) == 2
    assert store.names() == ["list", "count", "list", "count"]
