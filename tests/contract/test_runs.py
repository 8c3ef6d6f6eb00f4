"""Runs (celery_claims/runs.py): a completion record of an earlier run turns no later run away.

Every backend: memory (the specification), Redis, Valkey, Redis Cluster.
"""

from __future__ import annotations

import pytest

from celery_claims import (
    AlreadyClaimed,
    AlreadyDone,
    ClaimManager,
    GivenUp,
    InvalidArgument,
    Success,
    TookOver,
)
from celery_claims.runs import MAX_RUN, earlier_run, format_run, owner_run, parse_run, with_run
from celery_claims.testing import ManualClock

Q = "q-runs"
LEASE = 1000
KEEP = 60_000


def _done(manager: ClaimManager, task: str, owner: str, run: int | None) -> AlreadyDone:
    """``task`` claimed and completed by ``owner`` of ``run``; its record."""
    token = manager.claim_unless_done(Q, task, owner, LEASE, run=run).token
    assert token is not None
    manager.complete(token, KEEP)
    record = manager.done_record(Q, task)
    assert isinstance(record, AlreadyDone)
    return record


def test_a_later_run_claims_a_task_an_earlier_run_completed(manager: ClaimManager) -> None:
    # Given a task completed by run 5
    _done(manager, "t1", with_run("w/1/a.1", 5), 5)

    # When a copy of run 6 claims it
    result = manager.claim_unless_done(Q, "t1", with_run("w/1/a.2", 6), LEASE, run=6)

    # Then it is granted, and the record of run 5 stays until run 6 completes
    assert isinstance(result, Success)
    record = manager.done_record(Q, "t1")
    assert isinstance(record, AlreadyDone)
    assert owner_run(record.owner) == 5


def test_copies_of_the_same_or_an_earlier_run_are_still_done(manager: ClaimManager) -> None:
    # Given a task completed by run 5, then by run 7
    _done(manager, "t1", with_run("w/1/a.1", 5), 5)
    record = _done(manager, "t1", with_run("w/1/a.2", 7), 7)
    assert owner_run(record.owner) == 7

    # When copies of runs 7 (a redelivery), 6 and 5 (late copies of earlier runs) and a copy
    # naming no run claim it
    answers = [
        manager.claim_unless_done(Q, "t1", with_run("w/2/b.1", 7), LEASE, run=7),
        manager.claim_unless_done(Q, "t1", with_run("w/2/b.2", 6), LEASE, run=6),
        manager.claim_unless_done(Q, "t1", with_run("w/2/b.3", 5), LEASE, run=5),
        manager.claim_unless_done(Q, "t1", "w/2/b.4", LEASE),
    ]

    # Then each is answered with run 7's record
    assert answers == [record] * 4


def test_a_record_naming_no_run_turns_every_run_away(manager: ClaimManager) -> None:
    # Given a task completed by an owner naming no run (a plain task's id: an idempotency key)
    record = _done(manager, "t1", "w/1/a.1", None)

    # When a copy of some run claims it, Then it is done
    assert manager.claim_unless_done(Q, "t1", with_run("w/2/b.1", 9), LEASE, run=9) == record


def test_a_new_run_waits_for_a_live_claim_and_takes_an_expired_one_over(
    manager: ClaimManager, clock: ManualClock
) -> None:
    # Given a task completed by run 1, and run 2's copy holding it
    _done(manager, "t1", with_run("w/1/a.1", 1), 1)
    holder = with_run("w/1/a.2", 2)
    assert manager.claim_unless_done(Q, "t1", holder, LEASE, run=2).acquired

    # When another copy of run 2 claims it while the lease lives, then after it ran out
    live = manager.claim_unless_done(Q, "t1", with_run("w/2/b.1", 2), LEASE, run=2)
    clock.advance(LEASE)
    after = manager.claim_unless_done(Q, "t1", with_run("w/2/b.2", 2), LEASE, run=2)

    # Then it is held, then it takes the claim over (a crashed new run is not lost)
    assert isinstance(live, AlreadyClaimed)
    assert live.owner == holder
    assert isinstance(after, TookOver)
    assert after.previous_owner == holder


def test_a_given_up_record_turns_a_later_run_away(
    manager: ClaimManager, clock: ManualClock
) -> None:
    # Given a task given up as poison (no takeover allowed)
    assert manager.claim_unless_done(Q, "t1", "w/1/a.1", LEASE, max_takeovers=0).acquired
    clock.advance(LEASE)
    given_up = manager.claim_unless_done(Q, "t1", "w/1/a.2", LEASE, max_takeovers=0)
    assert isinstance(given_up, GivenUp)

    # When a copy of a run claims it, Then it is given up still
    answer = manager.claim_unless_done(Q, "t1", with_run("w/2/b.1", 3), LEASE, run=3)
    assert isinstance(answer, GivenUp)


@pytest.mark.parametrize("run", [0, -1, MAX_RUN + 1, True, 1.5, "5"])
def test_a_bad_run_is_refused_before_anything_changes(manager: ClaimManager, run: object) -> None:
    with pytest.raises(InvalidArgument, match="run"):
        manager.claim_unless_done(Q, "t1", "w/1/a.1", LEASE, run=run)  # type: ignore[arg-type]
    assert manager.is_claimed(Q, "t1") is None


def test_run_spelling_round_trips_and_names_runs_only_at_the_owner_end() -> None:
    assert parse_run(format_run(MAX_RUN)) == MAX_RUN
    assert format_run(36) == "10"
    assert parse_run("10") == 36
    assert [parse_run(x) for x in ("", "0", "A", "-1", 5, "1" * 12)] == [None] * 6
    assert owner_run(with_run("host/1/n.2", 70)) == 70
    assert owner_run("host~r5/1/n.2") is None
    assert earlier_run(with_run("o", 4), 5)
    assert not earlier_run(with_run("o", 5), 5)
    assert not earlier_run("o", 5)
    assert not earlier_run(with_run("o", 4), None)
