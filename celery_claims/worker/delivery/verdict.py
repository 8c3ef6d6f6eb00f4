"""What a copy does when the claim store does not take its token.

A refused token does not always mean another copy owns the task. The store may have lost the
claim (restarted without it, or a failover to a replica that had not seen it), this worker's
own pool process may have recorded the completion a moment ago, or this worker may have
re-claimed the task under the same owner (a new instance). :func:`recover` tells these apart
with a few more round trips, only on the rare refused token, and :func:`record_done`
uses it to record a completion whatever happened to the claim meanwhile;
:func:`restore_records` writes many completion records again at once, after a Sentinel
failover (:mod:`celery_claims.worker.transport.failover`). The main process
(the lease keeper) and the pool processes (the guard) share both, so each case is decided
one way.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.errors import ClaimError, ClaimNotFound, ClaimTokenError
from celery_claims.model import AlreadyClaimed, AlreadyDone, ClaimToken, GivenUp

__all__ = ["Verdict", "Recovery", "recover", "record_done", "restore_records"]


class Verdict(enum.Enum):
    """Whose the task is, after a refused token."""

    #: still this copy's: ``Recovery.token`` is its current token
    OURS = "ours"
    #: this copy's completion is recorded already
    RECORDED = "recorded"
    #: another copy owns the task, or finished it: this copy is stale
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class Recovery:
    """The verdict on a refused token, with the current token when it is :attr:`Verdict.OURS`.

    Attributes:
        verdict: whose the task is.
        token: the copy's current token (``OURS`` only).
        reclaimed: the claim had vanished from the store and was claimed again.
        detail: what was found, for the log.
    """

    verdict: Verdict
    token: ClaimToken | None = None
    reclaimed: bool = False
    detail: str = ""


def recover(
    manager: RedisClaimManager, token: ClaimToken, error: ClaimTokenError, lease_ms: int
) -> Recovery:
    """Decide whose the task of ``token`` is after the store refused it with ``error``.

    Raises:
        BackendUnavailable: the store could not be asked (decide again later).
    """
    queue_id, task_id, owner = token.queue_id, token.task_id, token.owner
    current = manager.get_token(queue_id, task_id, owner)
    if current is not None:
        # the same owner holds it under another instance: this worker re-claimed it
        return Recovery(Verdict.OURS, current, detail="re-claimed under the same owner")
    record = manager.done_record(queue_id, task_id)
    if record is not None:
        return _by_record(record, owner)
    if not isinstance(error, ClaimNotFound):
        holder = manager.is_claimed(queue_id, task_id)
        if holder is not None:
            # another owner's live lease: another copy owns the task
            return Recovery(Verdict.LOST, detail=f"{type(error).__name__}, held by {holder[0]}")
        # an expired entry of another owner only: a failover to a replica leaves one when
        # this copy took the task over on the old master after the replica's last sync (or
        # the copy that took it from this one died since). Nobody owns the task now.
    # Nobody holds it and nobody finished it: the store lost the claim. Claiming it again
    # under the same owner is safe: any other copy would have found no live entry either,
    # and whichever claims first owns the task
    result = manager.claim_unless_done(queue_id, task_id, owner, lease_ms)
    if isinstance(result, (AlreadyDone, GivenUp)):
        return _by_record(result, owner)
    if isinstance(result, AlreadyClaimed):
        return Recovery(Verdict.LOST, detail=f"claimed meanwhile by {result.owner}")
    return Recovery(Verdict.OURS, result.token, reclaimed=True, detail="claim had vanished")


def _by_record(record: AlreadyDone | GivenUp, owner: str) -> Recovery:
    if isinstance(record, GivenUp):
        return Recovery(Verdict.LOST, detail=f"given up after {record.takeovers} takeovers")
    if record.owner == owner:
        return Recovery(Verdict.RECORDED, detail="completion already recorded")
    return Recovery(Verdict.LOST, detail=f"completed by {record.owner}")


def record_done(
    manager: RedisClaimManager, token: ClaimToken, *, lease_ms: int, done_ttl_ms: int
) -> Recovery:
    """Record the completion of ``token``'s attempt, recovering a refused token first.

    Returns :attr:`Verdict.RECORDED` once the record is written (now or before), or
    :attr:`Verdict.LOST` if another copy owns or finished the task.

    Raises:
        BackendUnavailable: the store could not be reached (retry later).
    """
    try:
        manager.complete(token, done_ttl_ms)
        return Recovery(Verdict.RECORDED)
    except ClaimTokenError as exc:
        found = recover(manager, token, exc, lease_ms)
    if found.verdict is Verdict.OURS:
        assert found.token is not None
        manager.complete(found.token, done_ttl_ms)
        return Recovery(Verdict.RECORDED, reclaimed=found.reclaimed, detail=found.detail)
    return found


def restore_records(
    manager: RedisClaimManager,
    tokens: Sequence[ClaimToken],
    *,
    lease_ms: int,
    done_ttl_ms: int,
) -> list[Recovery]:
    """Write again the completion records of ``tokens``, as on a new master after a failover.

    Idempotent: a record already there (this owner's) is left as it is. Two pipelined round
    trips for any number of tokens: one writes every record whose claim the store still has,
    one reads the records of the others; only a task the store has neither a claim nor a
    record of costs more (it is claimed again under the same owner and recorded, as
    :func:`record_done` does).

    Returns:
        One verdict per token: :attr:`Verdict.RECORDED`, or :attr:`Verdict.LOST` where
        another copy owns or finished the task (nothing is written then).

    Raises:
        BackendUnavailable: the store could not be reached (try again later).
        BackendError: another store error.
    """
    written = manager.execute_each([manager.complete_call(t, done_ttl_ms) for t in tokens])
    found: list[Recovery | None] = []
    refused: list[int] = []
    for i, outcome in enumerate(written):
        if isinstance(outcome, ClaimTokenError):
            refused.append(i)
            found.append(None)
        elif isinstance(outcome, ClaimError):
            raise outcome
        else:
            found.append(Recovery(Verdict.RECORDED))
    calls = [manager.done_record_call(tokens[i].queue_id, tokens[i].task_id) for i in refused]
    records = manager.execute_each(calls)
    for i, record in zip(refused, records, strict=True):
        if isinstance(record, ClaimError):
            raise record
        if record is None:
            # neither a claim nor a record: the claim was taken and finished on the old master
            found[i] = record_done(manager, tokens[i], lease_ms=lease_ms, done_ttl_ms=done_ttl_ms)
        else:
            found[i] = _by_record(record, tokens[i].owner)
    return [f if f is not None else Recovery(Verdict.LOST) for f in found]
