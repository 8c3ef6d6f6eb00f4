"""Writing completion records again on a store that may have lost them (after a failover)."""

from __future__ import annotations

from celery_claims import RedisClaimManager
from celery_claims.model import AlreadyDone, ClaimToken
from celery_claims.worker.delivery.verdict import Verdict, restore_records

LEASE_MS = 60_000
TTL_MS = 3_600_000


def _claimed(claims: RedisClaimManager, queue: str, task: str, owner: str) -> ClaimToken:
    result = claims.claim_unless_done(queue, task, owner, LEASE_MS)
    assert result.token is not None
    return result.token


def test_records_written_again_whatever_the_store_kept_of_their_claims(
    claims: RedisClaimManager, queue: str
) -> None:
    # Given four finished attempts as a new master may have them after a failover: the claim
    # still there (the record went to the old master), the record there already, nothing at
    # all (claimed and finished on the old master), and another owner's live claim
    kept = _claimed(claims, queue, "kept", "w/1/a")
    recorded = _claimed(claims, queue, "recorded", "w/1/b")
    claims.complete(recorded, TTL_MS)
    before = claims.done_record(queue, "recorded")
    vanished = _claimed(claims, queue, "vanished", "w/1/c")
    claims.release(vanished)
    taken = _claimed(claims, queue, "taken", "w/1/d")
    claims.release(taken)
    _claimed(claims, queue, "taken", "other/2/e")

    # When their records are written again
    found = restore_records(
        claims, [kept, recorded, vanished, taken], lease_ms=LEASE_MS, done_ttl_ms=TTL_MS
    )

    # Then each is recorded under its own owner, the one already there left as it was, and
    # nothing is written where another copy owns the task
    assert [f.verdict for f in found] == [Verdict.RECORDED] * 3 + [Verdict.LOST]
    for token in (kept, recorded, vanished):
        record = claims.done_record(queue, token.task_id)
        assert isinstance(record, AlreadyDone)
        assert record.owner == token.owner
    assert claims.done_record(queue, "recorded") == before
    assert claims.done_record(queue, "taken") is None
    holder = claims.is_claimed(queue, "taken")
    assert holder is not None
    assert holder[0] == "other/2/e"

    # And writing them again once more changes nothing
    again = restore_records(claims, [kept, recorded, vanished], lease_ms=LEASE_MS,
                            done_ttl_ms=TTL_MS)  # fmt: skip
    assert [f.verdict for f in again] == [Verdict.RECORDED] * 3
    assert claims.done_record(queue, "recorded") == before
