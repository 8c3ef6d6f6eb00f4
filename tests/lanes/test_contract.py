"""The lane store contract: every store behaves like the memory store, the specification.

Parametrized over memory, Redis (bytes and decoded replies), Redis Cluster, PostgreSQL and
SQLite. The first tests are the original's own store tests.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

import pytest

from celery_claims.lanes import (
    ClaimedTask,
    InvalidValueError,
    LeaseLost,
    TaskClaimCandidate,
    TaskLease,
    TaskStatus,
    available_capacity,
    claim_due_for_lane,
)
from tests.lanes.conftest import MAIL, REPORTS, T0, Harness, lane_of

LEASE = T0 + timedelta(seconds=30)
STALE_BEFORE = T0 - timedelta(seconds=30)


def claim(harness: Harness, candidates: list[TaskClaimCandidate], limit: int) -> list[ClaimedTask]:
    """Call ``claim_candidates_for_lane`` for the mail lane at T0 with a 30 s lease."""
    lane = dataclasses.replace(MAIL, limit=limit)
    return list(harness.store.claim_candidates_for_lane(lane, candidates, STALE_BEFORE, T0, LEASE))


def make_processing(harness: Harness, task_id: int, lease_expires_at: datetime) -> None:
    """Enqueue a task and claim it (token 0 -> 1) with the given lease expiry."""
    claimed_at = min(T0, lease_expires_at) - timedelta(seconds=1)
    harness.store.enqueue(task_id, "send_email", next_run_at=claimed_at)
    claimed = harness.store.claim_candidates_for_lane(
        dataclasses.replace(MAIL, limit=100),
        [TaskClaimCandidate(0, task_id, 0, 1)],
        claimed_at - timedelta(seconds=30),
        claimed_at,
        lease_expires_at,
    )
    assert [c.task_id for c in claimed] == [task_id]


# --- the original's tests --------------------------------------------------------------------


def test_candidate_with_matching_token_is_claimed_with_the_next_token(harness: Harness) -> None:
    # Given task 42 with token 7, due, and nothing active in a lane of limit 2
    harness.store.enqueue(42, "send_email", next_run_at=T0)
    harness.force_token(42, 7)

    # When the store claims the candidate (42, 7 -> 8)
    claimed = claim(harness, [TaskClaimCandidate(0, 42, 7, 8)], limit=2)

    # Then one claim with the lease (42, 8), and the task is processing until the lease ends
    assert claimed == [ClaimedTask(0, 42, 8)]
    assert TaskLease(claimed[0].task_id, claimed[0].processing_token) == TaskLease(42, 8)
    task = harness.store.get_task(42)
    assert task.status is TaskStatus.PROCESSING
    assert task.processing_token == 8
    assert task.lease_expires_at == LEASE
    assert task.claimed_at == T0


def test_full_lane_claims_nothing(harness: Harness) -> None:
    # Given 2 tasks with live leases in a lane of limit 2, and a third one due
    make_processing(harness, 1, LEASE)
    make_processing(harness, 2, LEASE)
    harness.store.enqueue(3, "send_sms", next_run_at=T0)
    before = harness.snapshot()

    # When the store is asked to claim the due task
    claimed = claim(harness, [TaskClaimCandidate(0, 3, 0, 1)], limit=2)

    # Then nothing is claimed and nothing changed
    assert claimed == []
    assert harness.snapshot() == before


def test_three_pending_with_limit_two_claims_the_first_two_by_candidate_order(
    harness: Harness,
) -> None:
    # Given 3 pending tasks with token 0
    for task_id in (1, 2, 3):
        harness.store.enqueue(task_id, "send_email", next_run_at=T0)

    # When they are offered as candidates 3, 1, 2 to a lane of limit 2
    claimed = claim(
        harness,
        [
            TaskClaimCandidate(0, 3, 0, 1),
            TaskClaimCandidate(1, 1, 0, 1),
            TaskClaimCandidate(2, 2, 0, 1),
        ],
        limit=2,
    )

    # Then the first two candidates are claimed, tokens 0 -> 1, and the third stays pending
    assert claimed == [ClaimedTask(0, 3, 1), ClaimedTask(1, 1, 1)]
    assert harness.store.get_task(3).processing_token == 1
    assert harness.store.get_task(1).processing_token == 1
    third = harness.store.get_task(2)
    assert third.status is TaskStatus.PENDING
    assert third.processing_token == 0


def test_live_processing_task_with_limit_one_claims_nothing_and_leaves_pending_row(
    harness: Harness,
) -> None:
    # Given a live processing task and a pending one, in a lane of limit 1
    make_processing(harness, 1, LEASE)
    harness.store.enqueue(2, "send_email", next_run_at=T0)
    before = harness.snapshot()

    # When the pending task is offered
    claimed = claim(harness, [TaskClaimCandidate(0, 2, 0, 1)], limit=1)

    # Then nothing is claimed and the pending row is untouched
    assert claimed == []
    assert harness.snapshot() == before
    assert harness.store.get_task(2).status is TaskStatus.PENDING


def test_candidate_with_wrong_expected_token_is_skipped_and_the_next_is_claimed(
    harness: Harness,
) -> None:
    # Given two pending tasks with token 0 and a lane of limit 1
    harness.store.enqueue(1, "send_email", next_run_at=T0)
    harness.store.enqueue(2, "send_email", next_run_at=T0)

    # When the first candidate expects token 5 (someone claimed it since listing)
    claimed = claim(
        harness, [TaskClaimCandidate(0, 1, 5, 6), TaskClaimCandidate(1, 2, 0, 1)], limit=1
    )

    # Then it is skipped without using the lane's only slot, and the next one is claimed
    assert claimed == [ClaimedTask(1, 2, 1)]
    assert harness.store.get_task(1).processing_token == 0
    assert harness.store.get_task(1).status is TaskStatus.PENDING


@pytest.mark.parametrize(
    ("limit", "active", "available"), [(4, 0, 4), (4, 2, 2), (4, 4, 0), (4, 9, 0)]
)
def test_available_capacity_is_limit_minus_active_never_negative(
    limit: int, active: int, available: int
) -> None:
    assert available_capacity(limit, active) == available


# --- claimability ------------------------------------------------------------------------------


def test_expired_lease_is_reclaimed_and_frees_its_slot(harness: Harness) -> None:
    # Given a processing task whose lease expired exactly at T0, in a lane of limit 1
    make_processing(harness, 1, T0)

    # When it is offered again with its current token
    claimed = claim(harness, [TaskClaimCandidate(0, 1, 1, 2)], limit=1)

    # Then the expired holder's slot is free and the task is claimed by the new attempt
    assert claimed == [ClaimedTask(0, 1, 2)]
    assert harness.store.get_task(1).lease_expires_at == LEASE


def test_live_lease_is_not_claimable_even_with_room_in_the_lane(harness: Harness) -> None:
    # Given a processing task with a live lease, and room in the lane
    make_processing(harness, 1, LEASE)
    before = harness.snapshot()

    # When it is offered with its current token
    claimed = claim(harness, [TaskClaimCandidate(0, 1, 1, 2)], limit=5)

    # Then the compare-and-swap fails on "still claimable"
    assert claimed == []
    assert harness.snapshot() == before


def test_task_not_yet_due_is_a_miss(harness: Harness) -> None:
    # Given a task due one microsecond after the claim, and one due at the claim
    harness.store.enqueue(1, "send_email", next_run_at=T0 + timedelta(microseconds=1))
    harness.store.enqueue(2, "send_email", next_run_at=T0)

    # When both are offered to a lane of limit 1
    claimed = claim(harness, [TaskClaimCandidate(0, 1, 0, 1), TaskClaimCandidate(1, 2, 0, 1)], 1)

    # Then the future task is skipped and the due one claimed
    assert claimed == [ClaimedTask(1, 2, 1)]


def test_done_task_is_never_claimable(harness: Harness) -> None:
    # Given a completed task
    make_processing(harness, 1, LEASE)
    assert harness.store.complete(1, 1) is True

    # When it is offered with its token, long after its lease
    later = LEASE + timedelta(hours=1)
    claimed = harness.store.claim_candidates_for_lane(
        MAIL, [TaskClaimCandidate(0, 1, 1, 2)], later - timedelta(seconds=1), later,
        later + timedelta(seconds=1),
    )  # fmt: skip

    # Then nothing is claimed
    assert claimed == []
    assert harness.store.get_task(1).status is TaskStatus.DONE


def test_candidate_offered_twice_is_claimed_once(harness: Harness) -> None:
    # Given one due task
    harness.store.enqueue(1, "send_email", next_run_at=T0)

    # When it is offered twice in one batch
    claimed = claim(harness, [TaskClaimCandidate(0, 1, 0, 1), TaskClaimCandidate(1, 1, 0, 1)], 5)

    # Then the second offer misses: the first changed the token
    assert claimed == [ClaimedTask(0, 1, 1)]


def test_claim_counts_only_the_lanes_own_kinds(harness: Harness) -> None:
    # Given a live task in the reports lane and a due mail task, mail limit 1
    harness.store.enqueue(1, "render", next_run_at=T0 - timedelta(seconds=2))
    harness.store.claim_candidates_for_lane(
        REPORTS, [TaskClaimCandidate(0, 1, 0, 1)], STALE_BEFORE, T0 - timedelta(seconds=1), LEASE
    )
    harness.store.enqueue(2, "send_sms", next_run_at=T0)

    # When the mail task is offered
    claimed = claim(harness, [TaskClaimCandidate(0, 2, 0, 1)], limit=1)

    # Then the other lane's task takes no mail slot
    assert claimed == [ClaimedTask(0, 2, 1)]


def test_empty_candidate_list_claims_nothing(harness: Harness) -> None:
    harness.store.enqueue(1, "send_email", next_run_at=T0)
    before = harness.snapshot()
    assert claim(harness, [], limit=2) == []
    assert harness.snapshot() == before


# --- listing and counting ----------------------------------------------------------------------


def test_listing_returns_claimable_tasks_most_overdue_first_up_to_the_limit(
    harness: Harness,
) -> None:
    # Given due tasks at various times, an expired lease, a live lease, a future and a done task
    store = harness.store
    store.enqueue(10, "send_email", next_run_at=T0 - timedelta(seconds=5))
    store.enqueue(11, "send_sms", next_run_at=T0 - timedelta(seconds=5))
    store.enqueue(3, "send_sms", next_run_at=T0 - timedelta(seconds=1))
    make_processing(harness, 4, T0 - timedelta(seconds=3))  # expired 3 s ago
    make_processing(harness, 5, LEASE)  # live
    store.enqueue(6, "send_email", next_run_at=T0 + timedelta(seconds=1))  # future
    make_processing(harness, 7, LEASE)
    store.complete(7, 1)
    store.enqueue(8, "render", next_run_at=T0 - timedelta(seconds=9))  # other lane

    # When the mail kinds are listed at T0
    listed = store.list_claimable_by_kinds(T0, STALE_BEFORE, MAIL.kinds, 10)
    limited = store.list_claimable_by_kinds(T0, STALE_BEFORE, MAIL.kinds, 2)

    # Then by due time (next run, or lease expiry), ties by id, without live, future or done
    assert [task.id for task in listed] == [10, 11, 4, 3]
    assert [task.id for task in limited] == [10, 11]
    assert listed[2].status is TaskStatus.PROCESSING
    assert listed[2].processing_token == 1
    assert [t.id for t in store.list_claimable_by_kinds(T0, STALE_BEFORE, ["send_sms"], 10)] == [
        11,
        3,
    ]
    assert store.list_claimable_by_kinds(T0, STALE_BEFORE, MAIL.kinds, 0) == []


def test_listing_across_two_lanes_merges_them_in_due_order(harness: Harness) -> None:
    harness.store.enqueue(1, "render", next_run_at=T0 - timedelta(seconds=1))
    harness.store.enqueue(2, "send_sms", next_run_at=T0 - timedelta(seconds=2))
    listed = harness.store.list_claimable_by_kinds(T0, STALE_BEFORE, ["render", "send_sms"], 10)
    assert [task.id for task in listed] == [2, 1]


def test_active_count_sees_only_live_leases_of_the_kinds(harness: Harness) -> None:
    # Given two live leases, one expiring exactly now, and a pending task
    make_processing(harness, 1, LEASE)
    make_processing(harness, 2, T0 + timedelta(microseconds=1))
    make_processing(harness, 3, T0)
    harness.store.enqueue(4, "send_sms", next_run_at=T0)

    # Then the lease ending at T0 is no longer active at T0
    assert harness.store.count_active_processing_by_kinds(T0, MAIL.kinds) == 2
    assert harness.store.count_active_processing_by_kinds(T0, ["send_sms"]) == 0
    assert harness.store.count_active_processing_by_kinds(LEASE, MAIL.kinds) == 0


def test_payload_round_trips(harness: Harness) -> None:
    payload = '{"to": "ada@example.org", "subject": "héllo / {tag}"}'
    harness.store.enqueue(1, "send_email", next_run_at=T0, payload=payload)
    assert harness.store.get_task(1).payload == payload
    assert harness.store.list_claimable_by_kinds(T0, T0, MAIL.kinds, 1)[0].payload == payload


def test_unknown_task_is_none(harness: Harness) -> None:
    assert harness.store.get_task(404) is None


# --- complete, retry, heartbeat ----------------------------------------------------------------


def test_complete_marks_done_and_frees_the_slot(harness: Harness) -> None:
    # Given a lane of limit 1 filled by task 1, and task 2 due
    make_processing(harness, 1, LEASE)
    harness.store.enqueue(2, "send_email", next_run_at=T0)

    # When task 1's attempt completes
    assert harness.store.complete(1, 1) is True

    # Then it is done, and the slot is free for task 2
    assert harness.store.get_task(1).status is TaskStatus.DONE
    assert harness.store.count_unfinished(MAIL.kinds) == 1
    assert claim(harness, [TaskClaimCandidate(0, 2, 0, 1)], limit=1) == [ClaimedTask(0, 2, 1)]


def test_completing_twice_with_the_same_token_is_harmless(harness: Harness) -> None:
    make_processing(harness, 1, LEASE)
    assert harness.store.complete(1, 1) is True
    before = harness.snapshot()
    assert harness.store.complete(1, 1) is False
    assert harness.snapshot() == before


def test_stale_attempt_cannot_complete_after_a_takeover(harness: Harness) -> None:
    # Given task 1 claimed with token 1, its lease expired, and reclaimed with token 2
    make_processing(harness, 1, T0)
    assert claim(harness, [TaskClaimCandidate(0, 1, 1, 2)], limit=1) == [ClaimedTask(0, 1, 2)]
    before = harness.snapshot()

    # When the first attempt tries to complete, retry or renew
    # Then each raises LeaseLost carrying the stale token, and nothing changes
    with pytest.raises(LeaseLost) as lost:
        harness.store.complete(1, 1)
    assert (lost.value.task_id, lost.value.processing_token) == (1, 1)
    with pytest.raises(LeaseLost):
        harness.store.retry(1, 1, next_run_at=T0)
    with pytest.raises(LeaseLost):
        harness.store.heartbeat(1, 1, lease_expires_at=LEASE)
    assert harness.snapshot() == before
    assert harness.store.complete(1, 2) is True


def test_retry_gives_the_task_back_at_next_run_at(harness: Harness) -> None:
    # Given a claimed task
    make_processing(harness, 1, LEASE)

    # When its attempt asks for a retry in 10 s
    harness.store.retry(1, 1, next_run_at=T0 + timedelta(seconds=10))

    # Then it is a retry task, not active, claimable from then on with the next token
    task = harness.store.get_task(1)
    assert (task.status, task.processing_token) == (TaskStatus.RETRY, 1)
    assert task.lease_expires_at is None
    assert harness.store.count_active_processing_by_kinds(T0, MAIL.kinds) == 0
    assert harness.store.list_claimable_by_kinds(T0, STALE_BEFORE, MAIL.kinds, 5) == []
    later = T0 + timedelta(seconds=10)
    claimed = harness.store.claim_candidates_for_lane(
        MAIL, [TaskClaimCandidate(0, 1, 1, 2)], later, later, later + timedelta(seconds=1)
    )
    assert claimed == [ClaimedTask(0, 1, 2)]
    # And the retried attempt can no longer complete
    with pytest.raises(LeaseLost):
        harness.store.complete(1, 1)


def test_completing_a_retried_task_with_its_token_is_lease_lost(harness: Harness) -> None:
    make_processing(harness, 1, LEASE)
    harness.store.retry(1, 1, next_run_at=T0)
    before = harness.snapshot()
    with pytest.raises(LeaseLost, match="no longer processing"):
        harness.store.complete(1, 1)
    assert harness.snapshot() == before


def test_heartbeat_extends_the_lease_so_the_task_is_not_reclaimed(harness: Harness) -> None:
    # Given a task whose lease would expire at T0
    make_processing(harness, 1, T0)

    # When its attempt renews the lease to T0 + 30 s
    harness.store.heartbeat(1, 1, lease_expires_at=LEASE)

    # Then it stays active and is not claimable at T0
    assert harness.store.get_task(1).lease_expires_at == LEASE
    assert harness.store.count_active_processing_by_kinds(T0, MAIL.kinds) == 1
    assert claim(harness, [TaskClaimCandidate(0, 1, 1, 2)], limit=5) == []


def test_operations_on_an_unknown_task_raise_and_change_nothing(harness: Harness) -> None:
    harness.store.enqueue(1, "send_email", next_run_at=T0)
    before = harness.snapshot()
    with pytest.raises(InvalidValueError, match="unknown task id 404"):
        harness.store.complete(404, 1)
    with pytest.raises(InvalidValueError, match="unknown task id 404"):
        harness.store.retry(404, 1, next_run_at=T0)
    with pytest.raises(InvalidValueError, match="unknown task id 404"):
        harness.store.heartbeat(404, 1, lease_expires_at=LEASE)
    assert harness.snapshot() == before


# --- the algorithm over every store ------------------------------------------------------------


def test_claim_due_for_lane_fills_the_lane_then_refills_as_tasks_finish(harness: Harness) -> None:
    # Given 3 due mail tasks and a lane of limit 2
    for task_id in (1, 2, 3):
        harness.store.enqueue(task_id, "send_email", next_run_at=T0 - timedelta(seconds=1))
    clock = iter([T0, T0, T0 + timedelta(seconds=1), T0 + timedelta(seconds=1)]).__next__

    # When the lane is claimed, then task 1 completes, then the lane is claimed again
    first = claim_due_for_lane(harness.store, MAIL, 60, lane_of, clock=clock)
    harness.store.complete(1, 1)
    second = claim_due_for_lane(harness.store, MAIL, 60, lane_of, clock=clock)

    # Then the first pass takes 2 tasks, the second the remaining one
    assert [(task.id, lease) for task, lease in first] == [
        (1, TaskLease(1, 1)),
        (2, TaskLease(2, 1)),
    ]
    assert [(task.id, lease) for task, lease in second] == [(3, TaskLease(3, 1))]
    assert harness.store.get_task(3).lease_expires_at == T0 + timedelta(seconds=61)


def test_claim_due_for_lane_reclaims_an_abandoned_task_after_its_lease(harness: Harness) -> None:
    # Given a task claimed at T0 with a 10 s stale period, and then abandoned
    harness.store.enqueue(1, "send_sms", next_run_at=T0)
    at = iter([T0, T0]).__next__
    assert [
        lease for _, lease in claim_due_for_lane(harness.store, MAIL, 10, lane_of, clock=at)
    ] == [TaskLease(1, 1)]

    # When the lane is claimed just before and at the lease's end
    before_end = iter([T0 + timedelta(seconds=9)] * 2).__next__
    at_end = iter([T0 + timedelta(seconds=10)] * 2).__next__
    early = claim_due_for_lane(harness.store, MAIL, 10, lane_of, clock=before_end)
    late = claim_due_for_lane(harness.store, MAIL, 10, lane_of, clock=at_end)

    # Then only the second pass takes it over, with the next token
    assert early == []
    assert [(task.processing_token, lease) for task, lease in late] == [(1, TaskLease(1, 2))]
