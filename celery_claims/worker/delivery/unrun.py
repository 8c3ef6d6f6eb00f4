"""Copies acked without running: the task is done, its key is another's, it is refused, or
it is acknowledged at claim and another copy's live lease and journal entry keep it.

The endings ``ACK_UNRUN``, ``RESCHEDULE`` and ``REFUSE`` of :data:`~.state.ENDINGS`, written
once (:meth:`Unrun._ack_unrun`): the journal entry first, then the ack, Celery's
``task_ready`` and the ``task_skipped`` signal.
"""

from __future__ import annotations

import functools
from typing import Any

from celery.utils.log import get_logger

from celery_claims.claims.journal import Held
from celery_claims.claims.keys import owner_task_key
from celery_claims.errors import ClaimError, KeyRefused
from celery_claims.model import AlreadyClaimed, AlreadyDone
from celery_claims.observe.history import SkipReason
from celery_claims.worker import signals
from celery_claims.worker.compat import fail_unrun, republish, revoke_unrun, task_ready
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.holds import Holds
from celery_claims.worker.delivery.keyed import RESCHEDULES_HEADER
from celery_claims.worker.delivery.registry import Registry
from celery_claims.worker.delivery.state import State
from celery_claims.worker.delivery.wiring import Wiring
from celery_claims.worker.policy import acks_on_claim

__all__ = ["Unrun"]

logger = get_logger("celery_claims.worker")

#: Reasons of a skip whose task id never ran (a keyed task meeting another's key): its own
#: result is stored as REVOKED.
_NOT_RUN = frozenset({"key_held", "key_done"})


class Unrun:
    """Acks copies that do not run."""

    def __init__(self, w: Wiring, reg: Registry, holds: Holds) -> None:
        self.w = w
        self.reg = reg
        self.holds = holds

    def skip(self, copy: Copy, record: Any, reason: str) -> None:
        """The task is recorded done (or given up): ack without running (``SKIPPED``)."""
        self.holds.cancel_timer(copy)
        self.w.slots.take_back(copy)
        self.reg.move(copy, State.SKIPPED)
        request = copy.request
        self.w.counters.incr("skipped_done" if reason == "done" else f"skipped_{reason}")
        logger.info(
            "Skipped %s[%s]: %s; acked without running",
            request.name,
            request.id,
            # a keyed skip names the key and the task that held (or did) it
            f"key {copy.task_key} was done by task {_holder_task_id(record)} ({record.owner})"
            if reason == "key_done"
            else f"key {copy.task_key} {_skip_detail(record)}"
            if reason == "key_held"
            else f"claim {copy.claim_id} is held by {record.owner}'s live lease, its publish "
            f"journal entry in the store (acknowledged at claim: the two are its durable copy)"
            if reason == SkipReason.CLAIMED
            else f"claim {copy.claim_id} {_skip_detail(record)}",
        )
        # only the message goes: the result the first run stored stays as it is. A copy
        # acked because the task is claimed keeps the journal entry: it is the durable copy
        self._ack_unrun(
            request,
            reason,
            claim_id=copy.claim_id,
            record=record,
            key=_key_field(copy),
            settled=None
            if reason == SkipReason.CLAIMED
            else (copy.queue_id, copy.task_key, reason in ("done", "given_up")),
        )
        if reason in _NOT_RUN:
            # another task id held or finished the key: this one's own result says so (for a
            # copy of a finished attempt, the result its run stored stays). Stored last, so a
            # client that sees it finds the journal's entry too
            try:
                revoke_unrun(request, f"{reason}: {_skip_detail(record)}")
            except Exception as exc:
                logger.warning(
                    "Skipped %s[%s]: result not stored: %r", request.name, request.id, exc
                )

    def held(self, copy: Copy, holder: AlreadyClaimed) -> None:
        """Another owner's live lease holds the copy's task: hold the copy (``HELD``); or,
        where its task is acknowledged at claim, first ask the store whether the task's publish
        journal entry is there too, and if so ack the copy without running (``SKIPPED``,
        ``claimed``).

        Held, such a copy would stay unacked for as long as the holder runs, which is what
        acking at claim is for: past RabbitMQ's ``consumer_timeout`` its channel is closed
        and the worker goes down. Acking it keeps the safety rule (acked only where another
        durable copy is owned by a live lease): the entry and the live lease, read in one
        script (``journal_held.lua``), are that copy. The entry goes only once the task is
        over (done, given up, failed or revoked: :mod:`celery_claims.claims.journal`), and if
        the holder dies, its lease runs out and recovery publishes the entry again, to be
        taken over. The copy's own message is never that durable copy: on the Redis broker a
        restored message keeps its delivery tag, so the record this ack removes from
        ``unacked`` may be the one the holder's delivery would ack, but the holder's task
        does not rest on it. No entry, or no answer: held (fail closed), and asked again at
        each re-check (the holder writes the entry when its pool starts it).
        """
        ask = self.w.held_call
        if (
            ask is None
            or copy.key is not None
            or not acks_on_claim(copy.request.task, self.w.settings)
        ):
            self.holds.hold(copy, "held", holder=holder.owner, error=None)
            return
        answered = functools.partial(self._held_answer, copy, holder)
        try:
            call = ask(copy.queue_id, copy.task_key, copy.owner)
            if self.w.send(call, answered):
                return  # answered on the event loop, the copy still RECEIVED or HELD
            outcome: Any = self.w.manager.execute(call)
        except ClaimError as exc:
            outcome = exc
        answered(outcome)

    def _held_answer(self, copy: Copy, holder: AlreadyClaimed, outcome: Any) -> None:
        """The store's answer for a copy whose task another lease holds (:meth:`held`)."""
        if copy.state not in (State.RECEIVED, State.HELD):
            return  # the consumer's connection closed meanwhile: the copy is gone
        if isinstance(outcome, tuple) and outcome[0] is Held.JOURNALED:
            self.skip(copy, outcome[1], SkipReason.CLAIMED)
            return
        if isinstance(outcome, BaseException):
            self.w.counters.incr("held_check_failed")
            logger.debug("Claim %s: held, its journal entry not known: %r", copy.claim_id, outcome)
        # no entry (or the holder's lease ended meanwhile: the next re-check claims it)
        self.holds.hold(copy, "held", holder=holder.owner, error=None)

    def reschedule(self, copy: Copy, holder: AlreadyClaimed) -> None:
        """Another task holds the copy's key (``reschedule`` policy): its message is
        published again with a countdown, then this copy is acked (``SKIPPED``).

        The new message is a durable copy of the work before this one goes. Should the
        publish fail, the copy is held instead (``wait``), so nothing is lost.
        """
        key = copy.key
        assert key is not None
        count = key.reschedules + 1
        request = copy.request
        try:
            republish(request, key.spec.reschedule_s, {RESCHEDULES_HEADER: count})
        except Exception as exc:
            logger.warning(
                "Claim %s: could not reschedule %s[%s] (%r); held instead",
                copy.claim_id,
                request.name,
                request.id,
                exc,
            )
            self.holds.hold(copy, "held", holder=holder.owner, error=None)
            return
        self.holds.cancel_timer(copy)
        self.w.slots.take_back(copy)
        self.reg.move(copy, State.SKIPPED)
        self.w.counters.incr("rescheduled_key_held")
        logger.info(
            "Rescheduled %s[%s] in %g s (%d of at most %d): claim %s %s",
            request.name,
            request.id,
            key.spec.reschedule_s,
            count,
            key.spec.reschedule_max,
            copy.claim_id,
            _skip_detail(holder),
        )
        # the new message journals itself as it is published: the entry stays
        self._ack_unrun(
            request,
            "key_rescheduled",
            claim_id=copy.claim_id,
            record=holder,
            key=_key_field(copy),
            settled=None,
        )

    def refuse(self, request: Any, error: KeyRefused, queue_id: str, task_key: str) -> None:
        """A keyed task's message whose key cannot be made: never run, recorded as failed
        with ``error`` (its result, ``task_failure``, the ``task-failed`` event), then acked,
        as Celery fails a task whose arguments do not bind. Never a claim, never a copy;
        its publish journal entry (``queue_id``, ``task_key``: the attempt's) is cleared.
        """
        self.w.counters.incr("refused_key")
        logger.error(
            "Refused %s[%s]: %s; recorded as failed, acked without running",
            request.name,
            request.id,
            error,
        )
        try:
            fail_unrun(request, error)
        except Exception as exc:
            # the result backend is down: the message stays unacked, the broker redelivers
            # it and it is refused again; never acked without its failure recorded
            logger.warning(
                "Refused %s[%s]: failure not recorded: %r", request.name, request.id, exc
            )
            return
        # no record says it is over: without its entry cleared, journal recovery would
        # publish it again (to be refused again), up to claims_journal_max_republish times
        self._ack_unrun(
            request, "key_refused", claim_id="", settled=(queue_id, task_key, False), error=error
        )

    def _ack_unrun(
        self,
        request: Any,
        reason: str,
        *,
        claim_id: str,
        record: Any = None,
        key: str = "",
        settled: tuple[str, str, bool] | None,
        error: BaseException | None = None,
    ) -> None:
        """Ack a copy that does not run: the endings ``ACK_UNRUN``, ``RESCHEDULE`` and
        ``REFUSE`` of :data:`~.state.ENDINGS`, written once.

        ``settled``: the publish journal entry to clear (queue, task key, done), or None to
        keep it. It is cleared before the ack (see :meth:`_settle_before_gone`); Celery's
        ``task_ready`` always runs; ``task_skipped`` says why (``key``: a keyed copy's key
        field, which its claim id cannot give back: a queue name may hold a ``/``).
        """
        if settled is not None:
            self.w.on_gone(*settled)
        request.acknowledge()
        task_ready(request)
        extra = {} if error is None else {"error": error}
        signals.task_skipped.send(
            sender=request.task,
            request=request,
            reason=reason,
            claim_id=claim_id,
            record=record,
            holder_task_id=None if record is None else _holder_task_id(record),
            key=key,
            **extra,
        )


def _key_field(copy: Any) -> str:
    """A keyed copy's key field (``<task or namespace>[<key>]``), else ``""``."""
    key = getattr(copy, "key", None)
    return "" if key is None else str(key.field)


def _skip_detail(record: Any) -> str:
    """What a skipped (or rescheduled) copy met, for the log."""
    if isinstance(record, AlreadyClaimed):
        return f"is held by task {_holder_task_id(record)} ({record.owner})"
    if isinstance(record, AlreadyDone):
        return f"already done by {record.owner} (instance {record.instance})"
    return f"given up as poison after {getattr(record, 'takeovers', '?')} takeovers"


def _holder_task_id(record: Any) -> str | None:
    """The task id a keyed claim's holder (or a record's owner) names, or None."""
    task_key = owner_task_key(str(getattr(record, "owner", "") or ""))
    return None if task_key is None else task_key.rsplit(":", 2)[0]
