"""The claim protocol's rules (DESIGN §1), checked on every backend.

Each test reads Given / When / Then. The first block ports the original implementation's own
tests; the rest pins every rule of the semantics so the backends cannot drift apart.
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
    NotClaimOwner,
    StaleClaimToken,
    Success,
    TookOver,
)
from celery_claims.testing import ManualClock

Q = "emails"
LEASE = 30_000


# --- the original's own tests ----------------------------------------------------------------


def test_claiming_a_free_task_succeeds_with_a_lease_from_now(
    manager: ClaimManager, clock: ManualClock
) -> None:
    result = manager.claim(Q, "t1", "worker-1", LEASE)

    assert isinstance(result, Success)
    assert result.acquired
    token = result.token
    assert (token.queue_id, token.task_id, token.owner) == (Q, "t1", "worker-1")
    assert token.created_at == clock()
    assert token.expires_at == clock() + LEASE
    assert token.is_valid(clock())
    assert token.remaining_ms(clock()) == LEASE


def test_second_worker_gets_already_claimed_until_the_lease_expires(
    manager: ClaimManager, clock: ManualClock
) -> None:
    first = manager.claim(Q, "t1", "worker-1", 100)

    clock.advance(99)
    second = manager.claim(Q, "t1", "worker-2", 100)

    assert second == AlreadyClaimed(owner="worker-1", expires_at=first.token.expires_at)
    assert not second.acquired
    assert second.token is None


def test_an_expired_claim_is_taken_over_after_a_1_ms_lease(
    manager: ClaimManager, clock: ManualClock
) -> None:
    first = manager.claim(Q, "t1", "worker-1", 1)

    clock.advance(1)
    second = manager.claim(Q, "t1", "worker-2", LEASE)

    assert isinstance(second, TookOver)
    assert second.acquired
    assert second.previous_owner == "worker-1"
    assert second.token.owner == "worker-2"
    assert second.token.instance > first.token.instance


def test_ten_threads_racing_for_one_task_yield_exactly_one_success(
    manager: ClaimManager,
) -> None:
    barrier = threading.Barrier(10)
    results = []
    lock = threading.Lock()

    def race(i: int) -> None:
        barrier.wait()
        result = manager.claim(Q, "contended", f"worker-{i}", LEASE)
        with lock:
            results.append(result)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    winners = [r for r in results if isinstance(r, Success)]
    losers = [r for r in results if isinstance(r, AlreadyClaimed)]
    assert len(winners) == 1
    assert len(losers) == 9
    assert {r.owner for r in losers} == {winners[0].token.owner}


def test_queues_are_isolated_from_each_other(manager: ClaimManager) -> None:
    a = manager.claim("queue-a", "same-id", "worker-1", LEASE)
    b = manager.claim("queue-b", "same-id", "worker-2", LEASE)

    assert isinstance(a, Success)
    assert isinstance(b, Success)
    assert manager.active_claims("queue-a") == 1
    assert manager.active_claims("queue-b") == 1
    assert manager.is_claimed("queue-a", "same-id") == ("worker-1", a.token.expires_at)
    assert manager.is_claimed("queue-b", "same-id") == ("worker-2", b.token.expires_at)


def test_cleanup_removes_two_expired_claims_of_three(
    manager: ClaimManager, clock: ManualClock
) -> None:
    manager.claim(Q, "short-1", "worker-1", 10)
    manager.claim("other", "short-2", "worker-1", 10)
    manager.claim(Q, "long", "worker-1", LEASE)

    clock.advance(10)
    removed = manager.cleanup_expired()

    assert removed == 2
    assert manager.stats().expirations == 2
    assert [t.task_id for t in manager.list_claims(Q)] == ["long"]
    assert manager.list_claims("other") == []
    assert manager.cleanup_expired() == 0


def test_stats_after_a_success_and_a_contention(manager: ClaimManager) -> None:
    manager.claim(Q, "t1", "worker-1", LEASE)
    manager.claim(Q, "t1", "worker-2", LEASE)

    assert manager.stats() == ClaimStats(attempts=2, successes=1, contentions=1)


# --- claim ----------------------------------------------------------------------------------


def test_a_lease_of_zero_is_expired_at_once(manager: ClaimManager) -> None:
    manager.claim(Q, "t1", "worker-1", 0)

    assert manager.is_claimed(Q, "t1") is None
    assert manager.active_claims(Q) == 0
    assert isinstance(manager.claim(Q, "t1", "worker-2", LEASE), TookOver)


def test_the_same_owner_reclaims_a_live_claim_with_a_new_instance(
    manager: ClaimManager,
) -> None:
    first = manager.claim(Q, "t1", "worker-1", LEASE)

    again = manager.claim(Q, "t1", "worker-1", LEASE)

    assert isinstance(again, Success)
    assert again.token.instance > first.token.instance
    with pytest.raises(StaleClaimToken):
        manager.release(first.token)
    assert manager.stats() == ClaimStats(attempts=2, successes=2)


def test_the_same_owner_reclaims_an_expired_claim_as_success_not_takeover(
    manager: ClaimManager, clock: ManualClock
) -> None:
    manager.claim(Q, "t1", "worker-1", 5)
    clock.advance(10)

    again = manager.claim(Q, "t1", "worker-1", LEASE)

    assert isinstance(again, Success)
    assert manager.stats() == ClaimStats(attempts=2, successes=2)


def test_takeover_counts_as_takeover_not_success(manager: ClaimManager, clock: ManualClock) -> None:
    manager.claim(Q, "t1", "worker-1", 5)
    clock.advance(5)

    manager.claim(Q, "t1", "worker-2", LEASE)

    assert manager.stats() == ClaimStats(attempts=2, successes=1, takeovers=1)


def test_instances_strictly_increase_over_reclaims_and_takeovers(
    manager: ClaimManager, clock: ManualClock
) -> None:
    instances = []
    for owner in ["a", "a", "b", "c", "c"]:
        result = manager.claim(Q, "t1", owner, 1)
        assert result.token is not None
        instances.append(result.token.instance)
        clock.advance(1)

    assert instances == sorted(set(instances))


def test_instances_are_unique_within_a_queue_across_tasks(manager: ClaimManager) -> None:
    tokens = [manager.claim(Q, f"t{i}", "worker-1", LEASE).token for i in range(5)]

    assert len({t.instance for t in tokens if t is not None}) == 5


# --- release --------------------------------------------------------------------------------


def test_release_removes_the_claim_and_counts_an_ack(manager: ClaimManager) -> None:
    token = manager.claim(Q, "t1", "worker-1", LEASE).token
    assert token is not None

    manager.release(token)

    assert manager.is_claimed(Q, "t1") is None
    assert manager.stats().acks == 1
    assert isinstance(manager.claim(Q, "t1", "worker-2", LEASE), Success)


def test_release_does_not_check_expiry(manager: ClaimManager, clock: ManualClock) -> None:
    token = manager.claim(Q, "t1", "worker-1", 5).token
    assert token is not None
    clock.advance(100)

    manager.release(token)

    assert manager.stats().acks == 1


def test_release_of_a_released_claim_is_not_found(manager: ClaimManager) -> None:
    token = manager.claim(Q, "t1", "worker-1", LEASE).token
    assert token is not None
    manager.release(token)

    with pytest.raises(ClaimNotFound) as raised:
        manager.release(token)

    assert raised.value.token == token
    assert str(raised.value).startswith("Claim not found")


def test_release_after_a_takeover_is_stale(manager: ClaimManager, clock: ManualClock) -> None:
    old = manager.claim(Q, "t1", "worker-1", 5).token
    assert old is not None
    clock.advance(5)
    manager.claim(Q, "t1", "worker-2", LEASE)

    with pytest.raises(StaleClaimToken, match="Stale claim token"):
        manager.release(old)

    assert manager.is_claimed(Q, "t1") is not None


def test_release_with_the_right_instance_but_another_owner_is_not_owner(
    manager: ClaimManager,
) -> None:
    token = manager.claim(Q, "t1", "worker-1", LEASE).token
    assert token is not None

    with pytest.raises(NotClaimOwner, match="Not claim owner"):
        manager.release(replace(token, owner="impostor"))

    assert manager.is_claimed(Q, "t1") == ("worker-1", token.expires_at)


def test_release_errors_are_checked_not_found_then_stale_then_owner(
    manager: ClaimManager,
) -> None:
    token = manager.claim(Q, "t1", "worker-1", LEASE).token
    assert token is not None
    forged = replace(token, instance=token.instance + 1000, owner="impostor")

    with pytest.raises(StaleClaimToken):
        manager.release(forged)
    with pytest.raises(ClaimNotFound):
        manager.release(replace(forged, task_id="missing"))


# --- extend ---------------------------------------------------------------------------------


def test_extend_adds_to_the_old_expiry_not_to_now(
    manager: ClaimManager, clock: ManualClock
) -> None:
    token = manager.claim(Q, "t1", "worker-1", 1_000).token
    assert token is not None
    clock.advance(800)

    extended = manager.extend(Q, token, 500)

    assert extended.expires_at == token.expires_at + 500
    assert (extended.instance, extended.created_at) == (token.instance, token.created_at)
    assert manager.is_claimed(Q, "t1") == ("worker-1", token.expires_at + 500)
    assert manager.stats() == ClaimStats(attempts=1, successes=1)


def test_extend_looks_the_claim_up_in_the_queue_argument(manager: ClaimManager) -> None:
    token = manager.claim("queue-a", "t1", "worker-1", LEASE).token
    assert token is not None

    with pytest.raises(ClaimNotFound):
        manager.extend("queue-b", token, 1_000)

    other = manager.claim("queue-b", "t1", "worker-1", LEASE).token
    assert other is not None
    extended = manager.extend("queue-b", other, 1_000)
    assert extended.queue_id == "queue-b"
    assert manager.is_claimed("queue-a", "t1") == ("worker-1", token.expires_at)


def test_extend_after_a_takeover_is_stale_and_changes_nothing(
    manager: ClaimManager, clock: ManualClock
) -> None:
    old = manager.claim(Q, "t1", "worker-1", 5).token
    assert old is not None
    clock.advance(5)
    new = manager.claim(Q, "t1", "worker-2", LEASE).token
    assert new is not None

    with pytest.raises(StaleClaimToken):
        manager.extend(Q, old, 60_000)

    assert manager.is_claimed(Q, "t1") == ("worker-2", new.expires_at)


def test_extend_of_an_expired_unclaimed_entry_revives_it_like_the_original(
    manager: ClaimManager, clock: ManualClock
) -> None:
    token = manager.claim(Q, "t1", "worker-1", 5).token
    assert token is not None
    clock.advance(10)

    extended = manager.extend(Q, token, 100)

    assert extended.expires_at == token.expires_at + 100
    assert manager.is_claimed(Q, "t1") == ("worker-1", token.expires_at + 100)


# --- reads ----------------------------------------------------------------------------------


def test_reads_ignore_expired_claims(manager: ClaimManager, clock: ManualClock) -> None:
    short = manager.claim(Q, "short", "worker-1", 10).token
    long = manager.claim(Q, "long", "worker-1", LEASE).token
    assert short is not None
    assert long is not None

    clock.advance(10)

    assert manager.is_claimed(Q, "short") is None
    assert manager.get_token(Q, "short", "worker-1") is None
    assert manager.active_claims(Q) == 1
    assert manager.list_claims(Q) == [long]


def test_get_token_answers_only_the_owner(manager: ClaimManager) -> None:
    token = manager.claim(Q, "t1", "worker-1", LEASE).token

    assert manager.get_token(Q, "t1", "worker-1") == token
    assert manager.get_token(Q, "t1", "worker-2") is None
    assert manager.get_token(Q, "missing", "worker-1") is None


def test_list_claims_is_ordered_by_expiry(manager: ClaimManager) -> None:
    manager.claim(Q, "late", "w", 3_000)
    manager.claim(Q, "soon", "w", 1_000)
    manager.claim(Q, "mid", "w", 2_000)

    assert [t.task_id for t in manager.list_claims(Q)] == ["soon", "mid", "late"]


def test_reads_of_an_unknown_queue_are_empty(manager: ClaimManager) -> None:
    assert manager.is_claimed("never-used", "t1") is None
    assert manager.active_claims("never-used") == 0
    assert manager.list_claims("never-used") == []
    assert manager.stats() == ClaimStats()


def test_cleanup_with_a_limit_stops_after_the_limit(
    manager: ClaimManager, clock: ManualClock
) -> None:
    for i in range(5):
        manager.claim(Q, f"t{i}", "w", 1)
    clock.advance(1)

    assert manager.cleanup_expired(limit=3) == 3
    assert manager.cleanup_expired() == 2
    assert manager.stats().expirations == 5


def test_ids_with_hash_tag_and_separator_characters_do_not_collide(
    manager: ClaimManager,
) -> None:
    queues = ["a:b", "a%3Ab", "{a}", "%7Ba%7D", "a}{b", "ünï©ødé 🚀"]
    for i, queue_id in enumerate(queues):
        assert isinstance(manager.claim(queue_id, "t:{x}", f"w{i}", LEASE), Success)

    for i, queue_id in enumerate(queues):
        assert manager.is_claimed(queue_id, "t:{x}") is not None
        assert manager.get_token(queue_id, "t:{x}", f"w{i}") is not None
        assert manager.active_claims(queue_id) == 1
    assert manager.stats().successes == len(queues)


# --- the additions for the Celery integration ---------------------------------------------


def test_complete_releases_and_keeps_a_completion_record_for_its_ttl(
    manager: ClaimManager, clock: ManualClock
) -> None:
    token = manager.claim_unless_done(Q, "t1", "worker-1", LEASE).token
    assert token is not None

    manager.complete(token, 1_000)

    assert manager.is_claimed(Q, "t1") is None
    record = manager.done_record(Q, "t1")
    assert record == AlreadyDone(owner="worker-1", instance=token.instance, done_at=clock())
    assert manager.claim_unless_done(Q, "t1", "worker-2", LEASE) == record
    clock.advance(1_000)
    assert manager.done_record(Q, "t1") is None
    assert isinstance(manager.claim_unless_done(Q, "t1", "worker-2", LEASE), Success)


def test_a_completion_kept_for_no_time_replaces_an_earlier_record_of_the_task(
    manager: ClaimManager, clock: ManualClock
) -> None:
    # Given a task recorded done by worker-1, then claimed again by a plain claim (which
    # ignores records) and completed by worker-2 with a retention of 0
    first = manager.claim_unless_done(Q, "t1", "worker-1", LEASE).token
    assert first is not None
    manager.complete(first, 60_000)
    second = manager.claim(Q, "t1", "worker-2", LEASE).token
    assert second is not None

    manager.complete(second, 0)

    # Then the latest completion is the task's record, and it is kept for no time: the
    # earlier record does not answer for the task again (found by the model check)
    assert manager.done_record(Q, "t1") is None
    assert isinstance(manager.claim_unless_done(Q, "t1", "worker-3", LEASE), Success)


def test_plain_claim_ignores_completion_records(manager: ClaimManager) -> None:
    token = manager.claim(Q, "t1", "worker-1", LEASE).token
    assert token is not None
    manager.complete(token, 60_000)

    assert isinstance(manager.claim(Q, "t1", "worker-2", LEASE), Success)


def test_complete_with_a_stale_token_records_nothing(
    manager: ClaimManager, clock: ManualClock
) -> None:
    old = manager.claim(Q, "t1", "worker-1", 5).token
    assert old is not None
    clock.advance(5)
    manager.claim(Q, "t1", "worker-2", LEASE)

    with pytest.raises(StaleClaimToken):
        manager.complete(old, 60_000)

    assert manager.done_record(Q, "t1") is None
    assert manager.is_claimed(Q, "t1") is not None


def test_renew_moves_live_claims_to_now_plus_lease_and_reports_lost_ones(
    manager: ClaimManager, clock: ManualClock
) -> None:
    kept = manager.claim(Q, "kept", "worker-1", 1_000).token
    long = manager.claim(Q, "long", "worker-1", 60_000).token
    lost = manager.claim(Q, "lost", "worker-1", 10).token
    assert kept is not None
    assert long is not None
    assert lost is not None
    clock.advance(10)
    manager.claim(Q, "lost", "worker-2", LEASE)

    results = manager.renew(Q, [kept, long, lost], 5_000)

    assert results[0] == replace(kept, expires_at=clock() + 5_000)
    assert results[1] == long  # never shortened
    assert isinstance(results[2], StaleClaimToken)
    assert results[2].token == lost
    assert manager.is_claimed(Q, "kept") == ("worker-1", clock() + 5_000)
    assert manager.stats() == ClaimStats(attempts=4, successes=3, takeovers=1)


def test_renew_of_no_tokens_is_a_no_op(manager: ClaimManager) -> None:
    assert manager.renew(Q, [], 1_000) == []
