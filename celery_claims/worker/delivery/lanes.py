"""Fleet-wide lanes on Celery queues: at most ``limit`` tasks of a lane run at once.

``claims_lanes = {"video": {"queues": ["video"], "limit": 2}}`` puts every claimed task
delivered from the ``video`` queue (or only the task names listed under ``"kinds"``) in lane
``video``. The limit holds across the whole fleet, through the lane machinery of
:mod:`celery_claims.lanes`: a :class:`RedisTaskClaimStore`, whose claim script recounts the
lane's live leases and claims by compare-and-swap in one atomic step.

How a Celery message maps onto that machinery:

- A lane slot is a **ticket**: a record of the lane store (lane key = lane name, one kind =
  the lane name) that this worker created and claims whenever one of its messages needs a
  slot. While claimed (status processing, lease live) the ticket fills one of the lane's
  ``limit`` slots, fleet-wide; when the task ends the worker gives it back with ``retry``
  (lease cleared, claimable again) and reuses it for its next message. A worker therefore
  creates at most as many tickets as it has lane messages waiting or running at once, and a
  message costs no ``enqueue`` (two round trips) in the steady state.
- A **pass** offers the store this worker's own waiting messages, oldest first, each with its
  ticket, as the candidates of one claim
  (:func:`~celery_claims.worker.delivery.lane_tickets.claim_slots`): one round trip whatever
  the number waiting; the script counts the lane (and each key of a keyed lane) as it claims.
- A message is claimed (the exactly-once claim) before it waits for its lane: duplicates of
  it are held by the claim, and a crashed worker's waiting messages are redelivered and taken
  over like running ones.
- A full lane **holds** the message: unacked, its prefetch slot given back
  (``qos.increment_eventually()``, as Celery does for ETA tasks) so other queues keep
  flowing, its claim (and, on Redis, its ``unacked_index`` entry) renewed by the lease keeper,
  and re-checked by one timer per lane every ``claims_lane_recheck_ms``, never requeued.
  A slot freed by this worker wakes its lane at once.
- The lease keeper renews the tickets of running tasks with the claims; a crashed worker's
  slots come free when their leases expire (``claims_lease_ms``).
- Nobody else ever claims a worker's tickets, so those of a worker that is gone would stay in
  the store for good (a keyed one with its key's name). The **purge** removes every ticket
  nobody claimed, gave back or renewed for :data:`TICKET_GRACE_LEASES` lane leases: each
  worker runs it from its lease keeper once per lane lease (the first right at start), and
  the beat task ``celery_claims.cleanup_expired`` runs it too. A live worker whose ticket was
  purged (it sat unused that long, or the worker was paused past it) finds it gone on its
  next claim, renewal or release: it drops the ticket and takes a new one.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from celery.utils.log import get_logger

from celery_claims.errors import TaskCoreError, TaskNotFound
from celery_claims.lanes.model import TaskLaneConfig
from celery_claims.lanes.redis import RedisTaskClaimStore
from celery_claims.worker import signals
from celery_claims.worker.delivery.keyed import key_text, signature_of
from celery_claims.worker.delivery.lane_model import Lane, LaneSlot, LaneWaiter
from celery_claims.worker.delivery.lane_tickets import (
    LaneTickets,
    claim_slots,
    lane_lease_secs,
)
from celery_claims.worker.settings import ClaimsSettings
from celery_claims.worker.transport.loop import on_loop_soon

__all__ = ["WorkerLanes"]

logger = get_logger("celery_claims.worker")


class WorkerLanes(LaneTickets):
    """The lanes of one worker: waiting messages, tickets, passes, slot release.

    Passes run in the consumer's event loop (the gate, the lane timers, ``hub.call_soon``);
    :meth:`release` and :meth:`heartbeat` may run in any thread.

    Args:
        settings: the worker's settings (``lanes``, ``lane_recheck_ms``, ``lease_ms``).
        store: the shared lane store.
        counters: the worker's counters.
    """

    def __init__(self, settings: ClaimsSettings, store: RedisTaskClaimStore, counters: Any):
        self.settings = settings
        self.store = store
        self.counters = counters
        # a lane with a rate only limits nothing here (delivery/rates.py counts its starts)
        self.lanes = {spec.name: Lane(spec) for spec in settings.lanes if spec.limited}
        self._by_queue: dict[str, list[Lane]] = {}
        for lane in self.lanes.values():
            for queue in lane.spec.queues:
                self._by_queue.setdefault(queue, []).append(lane)
        self.stale_secs = lane_lease_secs(settings.lease_ms)
        #: when the lease keeper's next purge is due (``time.monotonic()``; 0: at once)
        self.purge_at = 0.0
        self._lock = threading.Lock()
        self._signatures: dict[str, inspect.Signature | None] = {}
        self.consumer: Any = None
        self.dispatch: Callable[[Any, LaneSlot], None] | None = None
        #: the worker's prefetch slot ledger (``lifecycle.SlotLedger``), set by the lifecycle
        self.slots: Any = None
        #: the lifecycle's :class:`~celery_claims.worker.transport.loop.LoopWaker` (set by it)
        self.waker: Any = None

    @staticmethod
    def store_lanes(settings: ClaimsSettings) -> list[TaskLaneConfig[str, str]]:
        """The lane configs a lane store must be built with for ``settings``."""
        return [Lane(spec).config for spec in settings.lanes if spec.limited]

    @staticmethod
    def new_store(settings: ClaimsSettings, client: Any) -> RedisTaskClaimStore:
        """The lane store of ``settings`` on the claim store's ``client``."""
        return RedisTaskClaimStore(
            client=client, lanes=WorkerLanes.store_lanes(settings), prefix=settings.prefix
        )

    def bind(self, consumer: Any, dispatch: Callable[[Any, LaneSlot], None]) -> None:
        """Attach the consumer (timer, hub) and the hand-off of a granted copy to the pool."""
        self.consumer = consumer
        self.dispatch = dispatch

    def lane_of(self, queue_id: str, task_name: str) -> Lane | None:
        """The lane a message of ``task_name`` from ``queue_id`` is in, or None."""
        for lane in self._by_queue.get(queue_id, ()):
            if lane.spec.covers(queue_id, task_name):
                return lane
        return None

    # --- admission and passes (event loop) --------------------------------------------------

    def key_of(self, queue_id: str, request: Any) -> str:
        """The key of ``request`` (delivered from ``queue_id``) in its keyed lane, or ``""``
        when it is in no keyed lane.

        Raises:
            KeyRefused: its key cannot be made from its arguments (see ``keyed.py``).
        """
        lane = self.lane_of(queue_id, request.name)
        if lane is None or not lane.spec.keyed:
            return ""
        name = request.name
        if name not in self._signatures:
            self._signatures[name] = signature_of(request.task)
        spec = lane.spec
        return key_text(
            name, spec.key_names, spec.key_fn, self._signatures[name], request.args, request.kwargs
        )

    def candidates(self, lane: Lane, limit: int) -> list[LaneWaiter]:
        """The waiting messages a pass offers the store, oldest first: the first ``limit``;
        in a keyed lane the first ``limit`` once each key's beyond ``limit_per_key`` are
        passed over, so the oldest message of every key is among them (fairness: a key with
        1,000 messages waiting does not hide one with 1).

        ``limit`` candidates are enough: a key the store finds at its limit holds at least as
        many live slots as it has candidates, so a pass that claims fewer than ``limit``
        leaves the lane full.
        """
        if not lane.spec.keyed:
            return list(itertools.islice(lane.waiting, limit))
        chosen: list[LaneWaiter] = []
        taken: dict[str, int] = {}
        for waiter in lane.waiting:
            if len(chosen) >= limit:
                break
            if taken.get(waiter.key, 0) < lane.spec.limit_per_key:
                taken[waiter.key] = taken.get(waiter.key, 0) + 1
                chosen.append(waiter)
        return chosen

    def admit(self, lane: Lane, copy: Any) -> None:
        """Queue a claimed message for its lane; a pass for it runs on the next loop turn.

        The gate has just spent this message's round trip on the claim, so the lane pass
        (another round trip) is left to the next turn of the event loop, where one pass
        serves every message that arrived meanwhile.
        """
        lane.waiting.append(LaneWaiter(copy.request, copy, key=copy.lane_key))
        self._soon(lane, "arrival")

    def run_pass(self, lane: Lane, why: str) -> None:
        """Give free slots to the oldest waiting messages; hold the rest and re-check later.

        Arrivals and wake-ups leave a pending re-check where it is, so held messages are
        re-checked once per ``claims_lane_recheck_ms`` however busy the lane is.
        """
        if not lane.waiting:
            self._cancel_timer(lane)
            return
        if why == "timer":
            self.counters.incr("lane_rechecks", sum(1 for w in lane.waiting if w.held))
        elif why == "wakeup":
            self.counters.incr("lane_wakeups")
        try:
            granted = claim_slots(
                self, lane, self.candidates(lane, lane.config.limit), self.stale_secs
            )
        except TaskCoreError as exc:
            if isinstance(exc, TaskNotFound) and self._drop_vanished(lane, exc.task_id):
                # nothing was claimed; the next pass, at once, makes the waiter a new ticket
                self._soon(lane, "vanished")
            else:
                self._unavailable(lane, exc)
            return
        lane.delay_ms = 0
        for waiter, token in granted:
            assert waiter.ticket is not None
            waiter.ticket.token = token
            lane.waiting.remove(waiter)
            self._grant(lane, waiter)
        self._hold_rest(lane)
        if not lane.waiting:
            self._cancel_timer(lane)
        elif lane.timer_entry is None:
            self._schedule(lane, self.settings.lane_recheck_ms)

    def _drop_vanished(self, lane: Lane, ticket_id: int) -> bool:
        """Forget a waiter's ticket the store no longer has (purged, or the store lost it);
        False if no waiter of ``lane`` holds it (then the pass backs off as on any error)."""
        for waiter in lane.waiting:
            if waiter.ticket is not None and waiter.ticket.id == ticket_id:
                waiter.ticket = None
                self.counters.incr("lane_tickets_vanished")
                logger.info(
                    "Lane %s: ticket %d is gone from the store; taking a new one",
                    lane.name,
                    ticket_id,
                )
                return True
        return False

    def _unavailable(self, lane: Lane, exc: TaskCoreError) -> None:
        """Hold the waiting messages and try the pass again later, backing off."""
        self.counters.incr("lane_unavailable")
        lane.delay_ms = (
            self.settings.unavailable_retry_ms
            if lane.delay_ms == 0
            else min(lane.delay_ms * 2, self.settings.unavailable_retry_max_ms)
        )
        logger.warning(
            "Lane %s: lane store unavailable (%s); %d message(s) wait, retrying in %.1f s",
            lane.name,
            exc,
            len(lane.waiting),
            lane.delay_ms / 1000,
        )
        self._hold_rest(lane)
        self._cancel_timer(lane)
        self._schedule(lane, lane.delay_ms)

    def _grant(self, lane: Lane, waiter: LaneWaiter) -> None:
        assert waiter.ticket is not None
        self.counters.incr("lane_acquired")
        logger.debug("Lane %s: slot for claim %s", lane.name, waiter.claim.claim_id)
        assert self.dispatch is not None
        if waiter.held:
            # it was reported waiting (task_held): report that it waits no more
            signals.lane_slot.send(
                sender=waiter.request.task,
                request=waiter.request,
                claim_id=waiter.claim.claim_id,
                lane=lane.name,
                instance=waiter.claim.instance,
            )
        self.dispatch(waiter.claim, LaneSlot(lane, waiter.ticket))

    def _hold_rest(self, lane: Lane) -> None:
        for waiter in lane.waiting:
            if waiter.held:
                continue
            waiter.held = True
            # a waiting message keeps its prefetch slot otherwise: give it back, as Celery
            # does for ETA requests, so the worker's other queues keep flowing
            if self.slots is not None:
                self.slots.give_back(waiter.claim, bounded=False)
            self.counters.incr("lane_held")
            request = waiter.request
            recheck_s = self.settings.lane_recheck_ms / 1000
            if lane.spec.keyed:
                logger.info(
                    "Held %s[%s]: lane %s is full (limit %d) or key %s is (limit_per_key %d); "
                    "kept unacked, re-checking every %.1f s",
                    request.name,
                    request.id,
                    lane.name,
                    lane.spec.limit,
                    waiter.key,
                    lane.spec.limit_per_key,
                    recheck_s,
                )
            else:
                logger.info(
                    "Held %s[%s]: lane %s is full (limit %d); kept unacked, re-checking every "
                    "%.1f s",
                    request.name,
                    request.id,
                    lane.name,
                    lane.spec.limit,
                    recheck_s,
                )
            signals.task_held.send(
                sender=request.task,
                request=request,
                reason="lane",
                claim_id=waiter.claim.claim_id,
                holder=None,
                recheck_s=recheck_s,
                lane=lane.name,
                lane_key=waiter.key,
                instance=waiter.claim.instance,
            )

    # --- timers -----------------------------------------------------------------------------

    def _schedule(self, lane: Lane, delay_ms: int) -> None:
        at = time.monotonic() + delay_ms / 1000
        if lane.timer_entry is not None and lane.pass_at is not None and lane.pass_at <= at:
            return
        self._cancel_timer(lane)
        lane.pass_at = at
        lane.timer_entry = self.consumer.timer.call_after(
            delay_ms / 1000, self._on_timer, (lane,), priority=6
        )

    def _cancel_timer(self, lane: Lane) -> None:
        entry, lane.timer_entry, lane.pass_at = lane.timer_entry, None, None
        if entry is not None:
            with contextlib.suppress(Exception):
                self.consumer.timer.cancel(entry)

    def _on_timer(self, lane: Lane) -> None:
        lane.timer_entry = None
        lane.pass_at = None
        self._safe_pass(lane, "timer")

    def _safe_pass(self, lane: Lane, why: str) -> None:
        try:
            self.run_pass(lane, why)
        except Exception:
            # never lose a waiting message to a bug: keep it and try again later
            logger.exception("Lane %s: pass failed", lane.name)
            with contextlib.suppress(Exception):
                self._schedule(lane, self.settings.lane_recheck_ms)

    def wake(self, lane: Lane) -> None:
        """Run a pass of ``lane`` soon, from any thread (a slot of this worker came free)."""
        if lane.waiting:
            self._soon(lane, "wakeup")

    def _soon(self, lane: Lane, why: str) -> None:
        # one pending pass per lane serves every arrival and wake-up until it runs (a racing
        # second call from another thread costs at most one extra pass)
        consumer = self.consumer
        if consumer is None or lane.soon:
            return
        lane.soon = True
        on_loop_soon(consumer, self.waker, self._soon_pass, lane, why)

    def _soon_pass(self, lane: Lane, why: str) -> None:
        lane.soon = False
        self._safe_pass(lane, why)

    # --- running tasks (any thread) ---------------------------------------------------------

    def release(self, slot: LaneSlot) -> None:
        """Free a running task's slot (one round trip) and wake its lane. Idempotent."""
        with self._lock:
            if slot.released:
                return
            slot.released = True
        if self.hand_back(slot):
            self.counters.incr("lane_released")
            self.give_back(slot.lane, slot.ticket)
        self.wake(slot.lane)

    # --- a waiting message leaves without a slot (event loop) -------------------------------

    def forget(self, copy: Any) -> LaneWaiter | None:
        """Remove ``copy`` from its lane's waiting list; returns its waiter or None."""
        for lane in self.lanes.values():
            for waiter in lane.waiting:
                if waiter.claim is copy:
                    lane.waiting.remove(waiter)
                    if waiter.ticket is not None:
                        self.give_back(lane, waiter.ticket)
                        waiter.ticket = None
                    if not lane.waiting:
                        self._cancel_timer(lane)
                    return waiter
        return None

    def drop_all(self) -> list[LaneWaiter]:
        """Forget every waiting message (the connection is closing); returns them."""
        dropped: list[LaneWaiter] = []
        for lane in self.lanes.values():
            self._cancel_timer(lane)
            while lane.waiting:
                waiter = lane.waiting.popleft()
                if waiter.ticket is not None:
                    self.give_back(lane, waiter.ticket)
                dropped.append(waiter)
        return dropped
