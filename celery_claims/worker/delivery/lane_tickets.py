"""Lane tickets: the lane-store records a worker claims to hold a lane's slots.

A worker makes a ticket when a lane's waiting message needs one, keeps it for reuse, renews
the tickets of running tasks (:meth:`LaneTickets.heartbeat`), and purges the tickets nobody
claimed, gave back or renewed for :data:`TICKET_GRACE_LEASES` lane leases (a worker gone).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from celery.utils.log import get_logger

from celery_claims.errors import InvalidValueError, LeaseLost, TaskCoreError, TaskNotFound
from celery_claims.lanes.dispatch import utc_now
from celery_claims.lanes.model import (
    MAX_TASK_ID,
)
from celery_claims.lanes.redis import RedisTaskClaimStore
from celery_claims.worker.delivery.lane_model import Lane, LaneSlot, Ticket

__all__ = ["TICKET_GRACE_LEASES", "TICKET_PURGE_LIMIT", "LaneTickets"]

logger = get_logger("celery_claims.worker")

#: Attempts at a fresh random ticket id before giving up (a collision is ~2**-40 likely).
_ID_ATTEMPTS = 5

#: Lane leases a ticket may sit unclaimed, unreleased and unrenewed before the purge removes
#: it. A live worker renews its running tickets several times per lease, so only a worker
#: gone (or stalled for that long) loses one, and losing one costs it a new ticket, nothing
#: more: the slot had been free to the fleet since its lease expired.
TICKET_GRACE_LEASES = 5

#: The most tickets of one lane one purge by a worker removes (the next one goes on).
TICKET_PURGE_LIMIT = 1000


class LaneTickets:
    """The tickets of one worker's lanes; its state is set by :class:`~.lanes.WorkerLanes`."""

    store: RedisTaskClaimStore
    counters: Any
    lanes: dict[str, Lane]
    stale_secs: int
    purge_at: float
    _lock: threading.Lock

    def take_ticket(self, lane: Lane) -> Ticket:
        """A free ticket of ``lane``, creating one in the store if none is free.

        Raises:
            TaskCoreError: the store failed while creating one.
        """
        with self._lock:
            if lane.free:
                return lane.free.pop()
        for _ in range(_ID_ATTEMPTS):
            ticket_id = secrets.randbelow(MAX_TASK_ID) + 1
            try:
                # due a second ago: claimable by the pass that follows, on any clock reading
                self.store.enqueue(
                    ticket_id, lane.kind, next_run_at=utc_now() - timedelta(seconds=1)
                )
            except InvalidValueError:
                continue  # the id is taken (astronomically unlikely): draw another
            self.counters.incr("lane_tickets")
            return Ticket(ticket_id, 0)
        raise InvalidValueError(f"lane {lane.name!r}: no free ticket id after {_ID_ATTEMPTS} draws")

    def give_back(self, lane: Lane, ticket: Ticket) -> None:
        """Return an unclaimed ticket to the free list."""
        with self._lock:
            lane.free.append(ticket)

    def purge(self, limit: int = TICKET_PURGE_LIMIT) -> int:
        """Remove from the store the tickets of every lane that nobody claimed, gave back or
        renewed for :data:`TICKET_GRACE_LEASES` lane leases (any thread).

        Each is removed atomically, only if still idle (see
        :meth:`~celery_claims.lanes.redis.RedisTaskClaimStore.purge_stale`); one of this
        worker's own free tickets among them leaves its free list too.

        Args:
            limit: the most tickets removed per lane.

        Returns:
            How many were removed.

        Raises:
            TaskCoreError: the store failed (tickets of earlier lanes may be removed).
        """
        stale_before = utc_now() - timedelta(seconds=self.stale_secs * TICKET_GRACE_LEASES)
        removed = 0
        for lane in self.lanes.values():
            gone = set(self.store.purge_stale(lane.config, stale_before=stale_before, limit=limit))
            if not gone:
                continue
            removed += len(gone)
            with self._lock:
                lane.free = [ticket for ticket in lane.free if ticket.id not in gone]
            logger.info("Lane %s: purged %d stale ticket(s)", lane.name, len(gone))
        if removed:
            self.counters.incr("lane_tickets_purged", removed)
        return removed

    def purge_due(self) -> None:
        """Run :meth:`purge` if a lane lease has passed since the last one (the lease keeper
        calls this every beat; the first call purges at once)."""
        now = time.monotonic()
        if now < self.purge_at:
            return
        self.purge_at = now + self.stale_secs
        try:
            self.purge()
        except TaskCoreError as exc:
            logger.warning("Lane keeper: could not purge stale tickets now: %s", exc)

    def heartbeat(self, slots: Sequence[LaneSlot]) -> None:
        """Renew the lane leases of running tasks (one batched round trip per call)."""
        live = [s for s in slots if not s.released]
        if not live:
            return
        lease = utc_now() + timedelta(seconds=self.stale_secs)
        try:
            results = self.store.heartbeat_many(
                [(s.ticket.id, s.ticket.token) for s in live], lease_expires_at=lease
            )
        except TaskCoreError as exc:
            self.counters.incr("lane_renew_unavailable")
            logger.warning("Lane keeper: lane store unavailable: %s", exc)
            return
        for slot, error in zip(live, results, strict=True):
            if error is None:
                self.counters.incr("lane_renewals")
            elif isinstance(error, (LeaseLost, TaskNotFound)):
                self.counters.incr("lane_lease_lost")
                logger.warning("Lane %s: a running task's slot lease was lost", slot.lane.name)
