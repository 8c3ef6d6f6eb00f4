"""How a copy that reached the pool ends without a record of its own: released, let go,
handed back (:data:`~.state.ENDINGS`), and the clearing of its journal entry around Celery's
own handler."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable

from celery.utils.log import get_logger

from celery_claims.errors import ClaimError, ClaimTokenError
from celery_claims.worker import signals
from celery_claims.worker.compat import before_gone, message_state, requeued, task_ready
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.registry import Registry
from celery_claims.worker.delivery.state import IN_POOL, State
from celery_claims.worker.delivery.turns import Turns
from celery_claims.worker.delivery.wiring import Wiring
from celery_claims.worker.transport.broker import forget_delivery

__all__ = ["Endings"]

logger = get_logger("celery_claims.worker")

#: Event loop ticks an ended copy's settlement waits for Celery's scheduled ack or reject.
#: kombu's hub runs one tick's callbacks in no set order (``Hub._ready`` is a set, kombu 5.3
#: to 5.7), so the ack may come one tick after a callback scheduled behind it.
_SETTLE_TICKS = 2


class Endings:
    """Ends copies that leave the pool without a completion record of their own."""

    def __init__(self, w: Wiring, reg: Registry, turns: Turns) -> None:
        self.w = w
        self.reg = reg
        self.turns = turns

    def leave_pool(self, copy: Copy, to: State, why: str) -> bool:
        """Move a copy in the pool to ``to`` and free its lane slot."""
        if not self.reg.move(copy, to, only_from=IN_POOL):
            return False
        slot, copy.lane_slot = copy.lane_slot, None
        if slot is not None and self.w.lanes is not None:
            # the slot goes back first: the next task of the lane need not wait for the
            # store write of this one's completion
            self.w.lanes.release(slot)
        if logger.isEnabledFor(logging.DEBUG):  # its claim id is built for the log only
            logger.debug("Claim %s: %s -> %s", copy.claim_id, why, to.value)
        return True

    def release(self, copy: Copy, why: str) -> None:
        """The attempt ended without success (``RELEASED``): its lane slot and its claim go;
        what happens to the message is Celery's handler's (:meth:`end_by_celery`)."""
        if copy.state is State.WAITING:
            self.turns.out_of_turn(copy)
            self.leave_lane(copy)
            self.reg.move(copy, State.RELEASED)
        elif not self.leave_pool(copy, State.RELEASED, why):
            return
        self.release_claim(copy, why)

    def leave_lane(self, copy: Copy) -> None:
        """A claimed copy that never reached the pool leaves its lane (its waiting place, or
        the slot it was granted while it waited for its turn) and takes its prefetch slot."""
        slot, copy.lane_slot = copy.lane_slot, None
        if self.w.lanes is not None:
            self.w.lanes.forget(copy)
            if slot is not None:  # granted, then waiting for its turn
                self.w.lanes.release(slot)
        self.w.slots.take_back(copy)

    def release_claim(self, copy: Copy, why: str) -> None:
        """Release the copy's claim in the store (best effort: an unreleased lease expires)."""
        if copy.token is None:
            return
        try:
            self.w.manager.release(copy.token)
        except ClaimTokenError as exc:
            logger.debug("Claim %s: already gone at release (%s)", copy.claim_id, exc)
            return
        except ClaimError as exc:
            # nothing to retry: the lease is no longer renewed and expires by itself
            logger.warning("Claim %s: %s, release failed: %s", copy.claim_id, why, exc)
            return
        self.w.counters.incr("released")
        logger.debug("Claim %s: %s, released", copy.claim_id, why)
        signals.claim_released.send(
            sender=copy.request.task,
            request=copy.request,
            token=copy.token,
            claim_id=copy.claim_id,
            reason=why,
        )

    def go_stale(self, copy: Copy, why: str, *, other_owner: bool) -> bool:
        """Another copy owns the task, or this one is given up: it must never start, its
        outcome is discarded (``STALE``), and its lane slot goes back now."""
        if not self.reg.go_stale(copy, why, other_owner=other_owner):
            return False
        slot, copy.lane_slot = copy.lane_slot, None
        if slot is not None and self.w.lanes is not None:
            self.w.lanes.release(slot)
        return True

    def let_go(self, copy: Copy, why: str) -> None:
        """End a stale copy without touching another copy's record (``STALE`` -> ``GONE``)."""
        if not self.reg.move(copy, State.GONE, only_from=frozenset({State.STALE})):
            return
        request = copy.request
        task_ready(request)
        if copy.handed_back:
            return
        self.w.on_loop(self._let_go_on_loop, copy)
        logger.warning(
            "Claim %s: stale copy of %s[%s] %s; nothing stored, message let go",
            copy.claim_id,
            request.name,
            request.id,
            why,
        )

    def _let_go_on_loop(self, copy: Copy) -> None:
        request = copy.request
        if copy.acked_at_claim:
            return  # nothing of it is left in the broker
        if forget_delivery(request):
            return  # Redis: the record in unacked is the live owner's too; leave it alone
        # a delivery of its own: ack it where another copy owns a live lease (that copy is
        # durable), hand it back otherwise
        with contextlib.suppress(Exception):
            if copy.other_owner:
                request.acknowledge()
            else:
                request.reject(requeue=True)

    def hand_back(self, copy: Copy, why: str) -> None:
        """The copy did not run and cannot be verified: its message goes back to the broker."""
        if not self.leave_pool(copy, State.GONE, why):
            return
        task_ready(copy.request)
        self.w.counters.incr("handed_back")
        logger.warning(
            "Claim %s: %s[%s] not run (%s); message handed back to the broker",
            copy.claim_id,
            copy.request.name,
            copy.request.id,
            why,
        )
        self.release_claim(copy, why)
        copy.handed_back = True
        self.w.on_loop(self.requeue, copy)

    def requeue(self, copy: Copy) -> None:
        """Hand the message back to the broker (on the consumer's thread); a message acked at
        claim has none: its journal entry stays, and recovery publishes it again once the
        released claim no longer holds it."""
        if copy.acked_at_claim:
            return
        with contextlib.suppress(Exception):
            copy.request.reject(requeue=True)

    def end_by_celery(
        self, copy: Copy, celery_handler: Callable[[], object], *, requeue: bool = False
    ) -> None:
        """Run Celery's handler for an attempt that ended without a record; its journal entry
        is cleared just before the handler's ack or reject takes the message for good (not
        if it requeues it: ``Reject(requeue=True)``, ``task_reject_on_worker_lost``).

        Before, not after: a worker killed between the two then leaves the message unacked,
        for the broker to deliver again (at least once, as Celery promises a task that did
        not finish), where the other order left an acked message's entry for journal
        recovery to publish again. Where the request cannot be hooked, the entry is cleared
        after the handler, once the message is known gone.
        """
        if copy.acked_at_claim:
            # nothing left in the broker for Celery's handler to ack or requeue: the journal
            # entry is the message now; it goes unless the attempt asked to be run again
            # (``requeue``: ``Reject(requeue=True)``), for recovery to publish it again
            celery_handler()
            if not requeue:
                self.w.on_gone(copy.queue_id, copy.task_key, False)
            return
        settle = functools.partial(self.w.on_gone, copy.queue_id, copy.task_key, False)
        if before_gone(copy.request, settle):
            celery_handler()
            return
        celery_handler()
        self._gone_unless_requeued(copy)

    def _gone_unless_requeued(self, copy: Copy) -> None:
        """An ended attempt's message is gone unless Celery's handler requeued it
        (``Reject(requeue=True)``, ``task_reject_on_worker_lost``).

        Celery's handler may only have scheduled its ack or reject (``call_soon_ack`` puts
        it on the event loop): then the message's fate is read on the loop after it.
        """
        if message_state(copy.request) is None and self.w.consumer is not None:
            self.w.waker.call_soon(self.w.consumer, self._gone_if_not_requeued, copy, _SETTLE_TICKS)
        else:
            self._gone_if_not_requeued(copy, 0)

    def _gone_if_not_requeued(self, copy: Copy, ticks: int) -> None:
        if message_state(copy.request) is None and ticks > 0 and self.w.consumer is not None:
            # kombu's hub keeps the callbacks of one tick in a set: this one may have run
            # before Celery's ack of the same tick; the ack has run by the next tick
            self.w.waker.call_soon(self.w.consumer, self._gone_if_not_requeued, copy, ticks - 1)
            return
        if not requeued(copy.request):
            self.w.on_gone(copy.queue_id, copy.task_key, False)

    @staticmethod
    def report_again(copy: Copy, celery_handler: Callable[[], object]) -> None:
        """A second report of an ended copy: Celery's handler only where it ran before."""
        # A second report of an ended copy (a hard time limit reports twice). Celery's
        # handler runs again only where it ran the first time: a stale, handed back or
        # completing copy's message must not be acked, nor a FAILURE stored over another
        # copy's result.
        if copy.state in (State.DONE, State.RELEASED, State.SKIPPED):
            celery_handler()
