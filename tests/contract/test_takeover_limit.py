"""The takeover limit: a task whose claim keeps being taken over is given up, visibly.

A poison task crashes every worker that runs it: its claim is never released, the lease
expires, the next copy takes it over and crashes too. ``claim_unless_done(...,
max_takeovers=n)`` counts the takeovers of each task and refuses the one that would exceed
``n`` with ``GivenUp``, leaving a record that answers every later copy the same way. Counted
are the holders that may have died of the task: the first claim's, and a takeover's holder
that marked its start (``mark_started``); one that died before it started the task is not.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from celery_claims import (
    AlreadyClaimed,
    AlreadyDone,
    ClaimManager,
    ClaimNotFound,
    ClaimStats,
    GivenUp,
    NotClaimOwner,
    StaleClaimToken,
    Success,
    TookOver,
)
from celery_claims.testing import ManualClock
from tests.contract.conftest import Backend, record_tasks, takeover_counts

Q = "emails"
LEASE = 1_000
KEEP = 60_000


def crash_and_take_over(
    manager: ClaimManager,
    clock: ManualClock,
    owners: list[str],
    limit: int | None,
    *,
    started: bool = True,
) -> list[object]:
    """Each owner claims the task in turn, and each one's lease runs out (its worker died),
    after it started the task (``started``, as a poison task's holders do) or before."""
    results: list[object] = []
    for owner in owners:
        result = manager.claim_unless_done(
            Q, "poison", owner, LEASE, max_takeovers=limit, given_up_ttl_ms=KEEP
        )
        results.append(result)
        token = getattr(result, "token", None)
        if started and token is not None:
            manager.mark_started(token)
        clock.advance(LEASE)
    return results


def taken_over_once(manager: ClaimManager, clock: ManualClock) -> TookOver:
    """The task claimed by w1, whose lease ran out, taken over by w2 under a limit of 1."""
    manager.claim_unless_done(Q, "poison", "w1", LEASE, max_takeovers=1)
    clock.advance(LEASE)
    took_over = manager.claim_unless_done(Q, "poison", "w2", LEASE, max_takeovers=1)
    assert isinstance(took_over, TookOver)
    return took_over


def test_the_takeover_past_the_limit_is_refused_with_given_up(backend: Backend) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task claimed by w1 and taken over twice (w2, w3), each lease running out
    first, *took_over = crash_and_take_over(manager, clock, ["w1", "w2", "w3"], limit=2)
    assert isinstance(first, Success)
    assert [type(r) for r in took_over] == [TookOver, TookOver]
    assert takeover_counts(backend, Q) == {"poison": 2}

    # When a fourth copy would take it over a third time, with a limit of 2
    result = manager.claim_unless_done(Q, "poison", "w4", LEASE, max_takeovers=2)

    # Then the task is given up: nobody holds it, the count is gone, the record says why
    assert result == GivenUp(previous_owner="w3", takeovers=2, given_up_at=clock())
    assert not result.acquired
    assert result.token is None
    assert manager.is_claimed(Q, "poison") is None
    assert manager.list_claims(Q) == []
    assert takeover_counts(backend, Q) == {}
    assert manager.done_record(Q, "poison") == result
    # only the attempt is counted, as for a copy answered by a completion record
    assert manager.stats() == ClaimStats(attempts=4, successes=1, takeovers=2)


def test_every_later_copy_of_a_given_up_task_gets_the_same_answer_until_retention_ends(
    backend: Backend,
) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task given up (limit 1) with a record kept for KEEP ms
    *_, given_up = crash_and_take_over(manager, clock, ["w1", "w2", "w3"], limit=1)
    assert isinstance(given_up, GivenUp)

    # When later copies arrive, with the limit, without it, or after the lease of any holder
    with_limit = manager.claim_unless_done(Q, "poison", "w4", LEASE, max_takeovers=1)
    without_limit = manager.claim_unless_done(Q, "poison", "w5", LEASE)
    clock.advance(KEEP - LEASE - 1)
    last_moment = manager.claim_unless_done(Q, "poison", "w6", LEASE)

    # Then each gets the record of the give-up, and no claim is taken
    assert with_limit == without_limit == last_moment == given_up
    assert manager.is_claimed(Q, "poison") is None

    # And once the record's retention ends, the task can be claimed again
    clock.advance(1)
    assert manager.done_record(Q, "poison") is None
    assert isinstance(manager.claim_unless_done(Q, "poison", "w7", LEASE), Success)


def test_a_limit_of_zero_refuses_the_first_takeover(
    manager: ClaimManager, clock: ManualClock
) -> None:
    manager.claim_unless_done(Q, "poison", "w1", LEASE, max_takeovers=0)
    clock.advance(LEASE)

    result = manager.claim_unless_done(Q, "poison", "w2", LEASE, max_takeovers=0)

    assert result == GivenUp(previous_owner="w1", takeovers=0, given_up_at=clock())


def test_the_claim_of_a_live_holder_is_not_a_takeover_and_not_counted(
    backend: Backend,
) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task held by w1, re-claimed by w1 itself after its lease ran out
    manager.claim_unless_done(Q, "poison", "w1", LEASE, max_takeovers=0)
    contested = manager.claim_unless_done(Q, "poison", "w2", LEASE, max_takeovers=0)
    clock.advance(LEASE)
    reclaimed = manager.claim_unless_done(Q, "poison", "w1", LEASE, max_takeovers=0)

    # Then neither the refused copy nor the same owner's re-claim counted as a takeover
    assert isinstance(contested, AlreadyClaimed)
    assert isinstance(reclaimed, Success)
    assert takeover_counts(backend, Q) == {}


def test_a_release_resets_the_count(backend: Backend) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task taken over once under a limit of 1, then released by its new owner
    took_over = taken_over_once(manager, clock)
    assert takeover_counts(backend, Q) == {"poison": 1}

    manager.release(took_over.token)

    # Then the count is gone, and the next crash gets a fresh allowance of one takeover
    assert takeover_counts(backend, Q) == {}
    manager.claim_unless_done(Q, "poison", "w3", LEASE, max_takeovers=1)
    clock.advance(LEASE)
    assert isinstance(
        manager.claim_unless_done(Q, "poison", "w4", LEASE, max_takeovers=1), TookOver
    )


def test_a_completion_resets_the_count(backend: Backend) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task taken over once under a limit of 1, then completed by its new owner
    took_over = taken_over_once(manager, clock)

    manager.complete(took_over.token, 10)

    # Then the count is gone with the claim, and the completion answers the next copy
    assert takeover_counts(backend, Q) == {}
    done = manager.claim_unless_done(Q, "poison", "w3", LEASE, max_takeovers=1)
    assert done == AlreadyDone(owner="w2", instance=took_over.token.instance, done_at=clock())


def test_cleanup_removes_the_count_with_the_expired_claim(backend: Backend) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task taken over once whose new holder's lease ran out too
    crash_and_take_over(manager, clock, ["w1", "w2"], limit=1)
    assert takeover_counts(backend, Q) == {"poison": 1}

    # When the expired claims are cleaned up
    assert manager.cleanup_expired() == 1

    # Then no count is left behind, and the next copy finds a free task
    assert takeover_counts(backend, Q) == {}
    assert isinstance(manager.claim_unless_done(Q, "poison", "w3", LEASE, max_takeovers=1), Success)


def test_cleanup_purges_a_given_up_record_past_its_retention(backend: Backend) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task given up, whose record's retention has ended
    *_, given_up = crash_and_take_over(manager, clock, ["w1", "w2"], limit=0)
    assert isinstance(given_up, GivenUp)
    assert record_tasks(backend, Q) == {"poison"}
    clock.advance(KEEP)

    # When expired state is cleaned up
    manager.cleanup_expired()

    # Then the record is gone from the store, like a completion record
    assert record_tasks(backend, Q) == set()
    assert manager.done_record(Q, "poison") is None


def test_without_a_limit_takeovers_are_neither_counted_nor_refused(backend: Backend) -> None:
    manager, clock = backend.manager, backend.clock
    owners = [f"w{i}" for i in range(8)]

    first, *took_over = crash_and_take_over(manager, clock, owners, limit=None)

    assert isinstance(first, Success)
    assert all(isinstance(r, TookOver) for r in took_over)
    assert takeover_counts(backend, Q) == {}
    assert manager.done_record(Q, "poison") is None
    assert manager.stats() == ClaimStats(attempts=8, successes=1, takeovers=7)


def test_a_given_up_record_with_no_retention_is_not_kept(backend: Backend) -> None:
    manager, clock = backend.manager, backend.clock
    manager.claim_unless_done(Q, "poison", "w1", LEASE)
    clock.advance(LEASE)

    result = manager.claim_unless_done(Q, "poison", "w2", LEASE, max_takeovers=0, given_up_ttl_ms=0)

    assert isinstance(result, GivenUp)
    assert manager.done_record(Q, "poison") is None
    assert manager.is_claimed(Q, "poison") is None
    assert record_tasks(backend, Q) == set()


def test_plain_claim_ignores_the_given_up_record(manager: ClaimManager, clock: ManualClock) -> None:
    *_, given_up = crash_and_take_over(manager, clock, ["w:1", "w:2"], limit=0)
    assert given_up == GivenUp(previous_owner="w:1", takeovers=0, given_up_at=clock() - LEASE)

    assert isinstance(manager.claim(Q, "poison", "w:3", LEASE), Success)


def test_a_stale_token_of_a_given_up_task_is_refused(
    manager: ClaimManager, clock: ManualClock
) -> None:
    token = manager.claim_unless_done(Q, "poison", "w1", LEASE).token
    assert token is not None
    clock.advance(LEASE)
    manager.claim_unless_done(Q, "poison", "w2", LEASE, max_takeovers=0)

    # the worker that lost the lease finds no claim: it cannot record a completion
    with pytest.raises(ClaimNotFound):
        manager.complete(token, KEEP)
    assert isinstance(manager.done_record(Q, "poison"), GivenUp)


def test_racing_copies_of_an_expired_task_yield_one_takeover_under_a_limit(
    backend: Backend,
) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task whose holder died
    manager.claim_unless_done(Q, "poison", "dead", LEASE)
    clock.advance(LEASE)
    barrier = threading.Barrier(8)
    results: list[object] = []

    def copy(i: int) -> None:
        barrier.wait()
        results.append(manager.claim_unless_done(Q, "poison", f"w{i}", KEEP, max_takeovers=1))

    # When eight copies race for it
    threads = [threading.Thread(target=copy, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Then exactly one took it over and counted once; the others see its live claim
    assert sorted(type(r).__name__ for r in results) == ["AlreadyClaimed"] * 7 + ["TookOver"]
    assert takeover_counts(backend, Q) == {"poison": 1}


def test_holders_that_died_before_starting_a_taken_over_task_are_not_counted(
    backend: Backend,
) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task whose first holder died, then four takeover holders that each died before
    # they started it (workers killed with the task still in their prefetch), under a limit of 1
    first, *took_over = crash_and_take_over(
        manager, clock, ["w1", "w2", "w3", "w4", "w5"], limit=1, started=False
    )

    # Then only the first holder's death counted: every copy took the task over, none gave
    # it up, and the next copy still gets it
    assert isinstance(first, Success)
    assert [type(r) for r in took_over] == [TookOver] * 4
    assert takeover_counts(backend, Q) == {"poison": 1}
    assert manager.done_record(Q, "poison") is None
    assert isinstance(
        manager.claim_unless_done(Q, "poison", "w6", LEASE, max_takeovers=1), TookOver
    )
    assert manager.stats() == ClaimStats(attempts=6, successes=1, takeovers=5)


def test_a_takeover_holder_that_marked_its_start_counts_when_it_dies(backend: Backend) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task taken over once (the first holder died), whose new holder started it
    took_over = taken_over_once(manager, clock)
    manager.mark_started(took_over.token)
    manager.mark_started(took_over.token)  # idempotent

    # When it dies too, the next copy would be its second counted takeover: given up
    clock.advance(LEASE)
    result = manager.claim_unless_done(Q, "poison", "w3", LEASE, max_takeovers=1)

    assert result == GivenUp(previous_owner="w2", takeovers=1, given_up_at=clock())


def test_a_holder_re_claiming_its_own_takeover_keeps_it_unstarted(backend: Backend) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a takeover holder that re-claims its own expired claim (a store that lost the
    # renewal, say) and then dies before it started the task
    manager.claim_unless_done(Q, "poison", "w1", LEASE, max_takeovers=1)
    clock.advance(LEASE)
    manager.claim_unless_done(Q, "poison", "w2", LEASE, max_takeovers=1)
    clock.advance(LEASE)
    assert isinstance(manager.claim_unless_done(Q, "poison", "w2", LEASE, max_takeovers=1), Success)
    clock.advance(LEASE)

    # Then its death is not counted either
    assert isinstance(
        manager.claim_unless_done(Q, "poison", "w3", LEASE, max_takeovers=1), TookOver
    )
    assert takeover_counts(backend, Q) == {"poison": 1}


def test_marking_the_start_of_a_claim_not_granted_by_a_takeover_changes_nothing(
    backend: Backend,
) -> None:
    manager = backend.manager
    first = manager.claim_unless_done(Q, "poison", "w1", LEASE, max_takeovers=1)
    assert isinstance(first, Success)
    before = backend.snapshot()

    manager.mark_started(first.token)

    assert backend.snapshot() == before


def test_only_the_holder_of_the_live_claim_can_mark_its_start(backend: Backend) -> None:
    manager, clock = backend.manager, backend.clock
    # Given a task taken over by w2 from w1
    old = manager.claim_unless_done(Q, "poison", "w1", LEASE, max_takeovers=1).token
    clock.advance(LEASE)
    took_over = manager.claim_unless_done(Q, "poison", "w2", LEASE, max_takeovers=1)
    assert old is not None
    assert isinstance(took_over, TookOver)
    before = backend.snapshot()

    # Then the stale holder's mark, and a mark of a task without a claim, are refused
    with pytest.raises(StaleClaimToken):
        manager.mark_started(old)
    with pytest.raises(NotClaimOwner):
        manager.mark_started(replace(took_over.token, owner="w9"))
    with pytest.raises(ClaimNotFound):
        manager.mark_started(replace(took_over.token, task_id="other"))
    assert backend.snapshot() == before
    # and w2's claim still counts as not started: its death is not counted
    clock.advance(LEASE)
    assert isinstance(
        manager.claim_unless_done(Q, "poison", "w3", LEASE, max_takeovers=1), TookOver
    )
