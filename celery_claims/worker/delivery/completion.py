"""A copy whose body succeeded (or retried, or was replaced): its completion recorded, then acked.

Three ways to the same record: the pool process settles it (the record and the delivery's
removal in one script, on the Redis broker), Celery's ack carries it (:meth:`Completion.take_ack`,
kombu's ack replaced by ``ack_done.lua``), or this process writes it on the consumer's pipe or
blocking. A record the store cannot take now is retried by the keeper (``COMPLETING``); the
message is acked only once it is written.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from celery.utils.log import get_logger

from celery_claims.errors import BackendUnavailable, ClaimError, ClaimTokenError
from celery_claims.worker.compat import task_ready
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.endings import Endings
from celery_claims.worker.delivery.guard import records_after_trace, records_left_to_worker
from celery_claims.worker.delivery.losses import Losses
from celery_claims.worker.delivery.registry import Registry
from celery_claims.worker.delivery.state import State
from celery_claims.worker.delivery.verdict import Recovery, Verdict, record_done
from celery_claims.worker.delivery.wiring import Wiring
from celery_claims.worker.transport.broker import BrokerRide

__all__ = ["Completion"]

logger = get_logger("celery_claims.worker")

_COMPLETING = frozenset({State.COMPLETING})


class Completion:
    """Records completions and acks their copies."""

    def __init__(self, w: Wiring, reg: Registry, ends: Endings, losses: Losses) -> None:
        self.w = w
        self.reg = reg
        self.ends = ends
        self.losses = losses
        #: the copies whose coming ack is to write their completion, by delivery tag
        self.riding: dict[Any, tuple[Copy, BrokerRide]] = {}
        #: the copies whose record the store could not take (``COMPLETING``, their ack
        #: waiting for it), by ``id``: the keeper retries them between its beats, at
        #: ``claims_unavailable_retry_ms`` doubling (:meth:`retry_unwritten`)
        self.unwritten: dict[int, Copy] = {}

    def pool_settle(self, copy: Copy) -> tuple[str, str, str] | None:
        """What the process running ``copy``'s body needs to settle it itself, or None.

        Where the claim store is the Redis broker's server and nothing after the body can
        fail the attempt (:func:`~.guard.records_left_to_worker`), the process that runs the
        body (a prefork child, a pool thread) writes the completion record and removes the
        delivery from kombu's ``unacked_index`` / ``unacked`` in one script, the one
        :meth:`take_ack` would send (``ack_done.lua``: the delivery goes only with this
        token's record), and waits for it before it reports success. A success reported for
        such a copy therefore means the record is written and the delivery removed: its ack
        only forgets the delivery in kombu's memory, so the event loop makes no round trip
        for it, and a main process paused or killed after the body returned cannot let the
        task run again. Any other outcome is reported as a failure (``StaleCopy``,
        ``ClaimUnverified``) and handled as before.

        Returns:
            kombu's unacked index and unacked keys and the delivery tag, for the request dict.
        """
        request = copy.request
        if not (copy.guarded and self.w.ride_acks) or request.acknowledged:
            return None
        if not records_left_to_worker(request):
            return None
        message = request.message
        tag = getattr(message, "delivery_tag", None)
        ride = BrokerRide.of(getattr(message, "channel", None), self.w.manager.client)
        if ride is None or tag is None:
            return None
        return (ride.keys[0], ride.keys[1], str(tag))

    def succeeded(self, copy: Copy, celery_handler: Callable[[], object]) -> None:
        """The body returned and the result was stored (``on_success``)."""
        if copy.state is State.STALE:
            self.w.counters.incr("fenced_success")
            self.ends.let_go(copy, "succeeded after it went stale; nothing recorded")
            return
        if copy.state not in (State.QUEUED, State.RUNNING):
            self.ends.report_again(copy, celery_handler)
            return
        if copy.guarded and self.w.ride_acks and not copy.request.acknowledged:
            if not self._ride(copy, celery_handler):
                # the pool process may have left the record to the ack, which cannot carry
                # it here: written from this process (it recognises a record already there)
                self.record(copy, "succeeded", celery_handler)
            return
        if (
            copy.guarded
            and not (self.w.records_left and records_left_to_worker(copy.request))
            and not records_after_trace(copy.request)
        ):
            # the pool process recorded the completion before the result was stored
            self.ends.leave_pool(copy, State.DONE, "succeeded")
            self.w.recent.add(copy.token)
            self.w.counters.incr("completed")
            celery_handler()
            self.w.on_gone(copy.queue_id, copy.task_key, True)
            return
        # an unguarded task, one whose pool process left the record to this process, or a
        # canvas part (its pool process may have recorded it after the trace, or not)
        self.record(copy, "succeeded", celery_handler, on_pipe=True)

    def _ride(self, copy: Copy, celery_handler: Callable[[], object]) -> bool:
        """Let Celery's ack of a succeeded copy write its completion (:meth:`take_ack`).

        On the Redis broker with the claim store on the same server, kombu's ack (two
        commands in one round trip) is replaced by one script that records the completion
        and removes the delivery only if the record is this copy's: the ack costs no round
        trip more than Celery's own, and the record and the ack are one step. False (nothing
        done) where that cannot apply: another transport or server.
        """
        request = copy.request
        message = request.message
        tag = getattr(message, "delivery_tag", None)
        ride = BrokerRide.of(getattr(message, "channel", None), self.w.manager.client)
        if ride is None or tag is None:
            return False
        self.ends.leave_pool(copy, State.COMPLETING, "succeeded")
        ride.hook_ack(self.take_ack)
        copy.ride_tag = tag
        self.riding[tag] = (copy, ride)
        # Celery schedules its ack on the event loop (consumer.call_soon_ack). Should it never
        # come, the keeper writes the record of a COMPLETING copy, and the message, unacked,
        # is redelivered and skipped.
        celery_handler()
        return True

    def take_ack(self, tag: Any) -> bool:
        """kombu's ack of ``tag`` (on the consumer's thread): True if a ride took it."""
        riding = self.riding.pop(tag, None)
        if riding is None:
            return False
        copy, ride = riding
        copy.ride_tag = None
        assert copy.token is not None
        if copy.pool_settles:
            # its pool process recorded the completion and removed the delivery before it
            # reported success (pool_settle): nothing of it is left in the broker
            ride.forget(tag)
            self.completed(copy, "succeeded, settled by its pool process")
            return True
        try:
            call = self.w.manager.ack_done_call(
                copy.token, self.w.settings.done_ttl_ms, ride.keys, str(tag)
            )
            self.w.manager.execute(call)
        except ClaimTokenError:
            # the claim changed meanwhile (re-claimed after a store restart, recorded under
            # another token, taken over): decided the slow way, the delivery left until then
            copy.deferred_ack = functools.partial(ride.ack, tag)
            self.complete_deferred(copy)
            return True
        except Exception as exc:
            # the store, the broker's own server, is unreachable (or a bug): keep renewing,
            # the keeper writes the record and then acks; until then nothing is acked
            copy.deferred_ack = functools.partial(ride.ack, tag)
            self.w.counters.incr("completion_deferred")
            logger.warning("Claim %s: succeeded, completion deferred: %s", copy.claim_id, exc)
            self.unwritten_now(copy)
            return True
        ride.forget(tag)
        self.completed(copy, "succeeded")
        return True

    def record(
        self,
        copy: Copy,
        why: str,
        celery_handler: Callable[[], object],
        *,
        on_pipe: bool = False,
    ) -> None:
        """Record done from this process (retries, replacements, unguarded tasks, and tasks
        whose pool process left the record to it), then run Celery's handler (the ack).

        ``on_pipe``: send the record on the consumer's pipe where it can go there; Celery's
        handler then runs once it is recorded (:meth:`_completed`, by the reply or, should the
        reply not come, by the keeper), and the event loop goes on meanwhile.
        """
        if not self.ends.leave_pool(copy, State.COMPLETING, why):
            celery_handler()
            return
        if on_pipe and copy.token is not None:
            # the pool process may have sent the record ahead: found there, it counts
            call = self.w.manager.record_call(copy.token, self.w.settings.done_ttl_ms)
            copy.deferred_ack = celery_handler
            if self.w.send(call, functools.partial(self._record_replied, copy, why)):
                return
            copy.deferred_ack = None
        self._record_now(copy, why, celery_handler)

    def _record_replied(self, copy: Copy, why: str, outcome: Any) -> None:
        """The reply to a record sent on the pipe (event loop)."""
        if copy.state is not State.COMPLETING:
            return  # recorded meanwhile (the keeper), Celery's handler with it
        if not isinstance(outcome, BaseException):
            self.completed(copy, why)  # runs Celery's handler (copy.deferred_ack)
            return
        # refused (a store restart lost the claim, another copy took it) or not written:
        # decided the blocking way, as when it could not be sent
        handler, copy.deferred_ack = copy.deferred_ack, None
        unreachable = outcome if isinstance(outcome, BackendUnavailable) else None
        self._record_now(copy, why, handler or (lambda: None), unreachable=unreachable)

    def _record_now(
        self,
        copy: Copy,
        why: str,
        celery_handler: Callable[[], object],
        *,
        unreachable: BackendUnavailable | None = None,
    ) -> None:
        """Write the record of a ``COMPLETING`` copy (blocking), then run Celery's handler;
        a store that cannot take it leaves the handler to the record's retry (the keeper)
        (``unreachable``: the store was found unreachable just now, it is not asked again)."""
        try:
            if unreachable is not None:
                raise unreachable
            found = self._record_done(copy)
        except ClaimError as exc:
            # unreachable, or refusing the write (an error reply: NOREPLICAS, BUSY):
            # keep renewing it and retry from the keeper; the attempt is done, and a
            # duplicate must not take the claim over while the record cannot be written.
            # Celery's handler (the ack) waits for the record: on the Redis broker a copy
            # that took the task over meanwhile shares this delivery's entry in unacked, and
            # the ack would delete it. The worker's books do not wait (task_ready now).
            self.w.counters.incr("completion_deferred")
            log = logger.warning if isinstance(exc, BackendUnavailable) else logger.error
            log("Claim %s: %s, completion deferred: %s", copy.claim_id, why, exc)
            task_ready(copy.request)
            copy.deferred_ack = celery_handler
            self.unwritten_now(copy)
            return
        if found.verdict is Verdict.LOST:
            self.losses.lose(copy, found.detail)
            return
        self.completed(copy, why)
        celery_handler()

    def _record_done(self, copy: Copy) -> Recovery:
        """Write the completion record of ``copy`` (one round trip; more only to recover)."""
        assert copy.token is not None
        return record_done(
            self.w.manager,
            copy.token,
            lease_ms=copy.lease_ms,
            done_ttl_ms=self.w.settings.done_ttl_ms,
        )

    def completed(self, copy: Copy, why: str) -> None:
        """The record is written (``COMPLETING`` -> ``DONE``): its journal entry goes, then the
        ack that waited for it, on the consumer's thread."""
        if not self.reg.move(copy, State.DONE, only_from=_COMPLETING):
            return
        if copy.ride_tag is not None:
            # recorded before Celery's ack came (by the keeper): kombu's own ack will do
            self.riding.pop(copy.ride_tag, None)
            copy.ride_tag = None
        self.w.recent.add(copy.token)
        self.w.counters.incr("completed")
        self.w.on_gone(copy.queue_id, copy.task_key, True)
        if logger.isEnabledFor(logging.DEBUG):  # its claim id is built for the log only
            logger.debug("Claim %s: %s, recorded done", copy.claim_id, why)
        ack, copy.deferred_ack = copy.deferred_ack, None
        if ack is not None:
            self.w.on_loop(_quietly, ack, copy)

    def unwritten_now(self, copy: Copy) -> None:
        """``copy``'s record could not be written: retried soon by the keeper."""
        self.unwritten[id(copy)] = copy
        self.w.wake_keeper()

    def retry_unwritten(self) -> bool:
        """Retry every record of :attr:`unwritten` (the keeper's thread); True if some
        are still unwritten."""
        for copy in list(self.unwritten.values()):
            self.complete_deferred(copy)
        return bool(self.unwritten)

    def complete_deferred(self, copy: Copy) -> None:
        """Retry a completion the store could not take (``COMPLETING``)."""
        if copy.state is not State.COMPLETING:
            self.unwritten.pop(id(copy), None)
            return
        try:
            found = self._record_done(copy)
        except ClaimError as exc:
            logger.debug("Claim %s: completion still deferred: %s", copy.claim_id, exc)
            return
        self.unwritten.pop(id(copy), None)
        if found.verdict is Verdict.LOST:
            self.losses.lose(copy, found.detail)
        else:
            if found.reclaimed:
                logger.warning(
                    "Claim %s: the claim store had lost it; recorded done all the same",
                    copy.claim_id,
                )
            self.completed(copy, "deferred completion")


def _quietly(ack: Callable[[], object], copy: Copy) -> None:
    """A deferred ack; a failure is logged (the broker then redelivers the message, whose
    copies are skipped: the completion is recorded)."""
    try:
        ack()
    except Exception as exc:
        logger.warning("Claim %s: recorded done, ack failed: %r", copy.claim_id, exc)
