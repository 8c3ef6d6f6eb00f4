"""The worker's one boundary with the lane store: a message (string task id, ms) holds a
**ticket** (an int-id record of the lane store) while it waits or runs; times are converted
here (:func:`lane_lease_secs`, :func:`claimable_now`); a pass claims slots for its waiting
messages in one round trip (:func:`claim_slots`). Tickets are made when needed, kept for
reuse, renewed while their tasks run, handed back, and purged after :data:`TICKET_GRACE_LEASES`
idle lane leases (a worker gone).
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from celery.utils.log import get_logger

from celery_claims.errors import InvalidValueError, LeaseLost, TaskCoreError, TaskNotFound
from celery_claims.lanes.dispatch import TOKEN_OVERFLOW_MESSAGE, utc_now
from celery_claims.lanes.model import (
    MAX_PROCESSING_TOKEN,
    MAX_TASK_ID,
    TaskClaimCandidate,
)
from celery_claims.lanes.redis import RedisTaskClaimStore
from celery_claims.worker.delivery.lane_model import Lane, LaneSlot, LaneWaiter, Ticket

__all__ = [
    "TICKET_GRACE_LEASES",
    "TICKET_PURGE_LIMIT",
    "LaneTickets",
    "claim_slots",
    "claimable_now",
    "lane_lease_secs",
]

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


def lane_lease_secs(lease_ms: int) -> int:
    """The lane lease of a worker whose claim lease is ``lease_ms``: whole seconds (the lane
    algorithm's unit), at least the claim lease."""
    return max(1, math.ceil(lease_ms / 1000))


def claimable_now() -> datetime:
    """A ``next_run_at`` that every clock reading takes as passed: a second ago."""
    return utc_now() - timedelta(seconds=1)


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
                self.store.enqueue(ticket_id, lane.kind, next_run_at=claimable_now())
            except InvalidValueError:
                continue  # the id is taken (astronomically unlikely): draw another
            self.counters.incr("lane_tickets")
            return Ticket(ticket_id, 0)
        raise InvalidValueError(f"lane {lane.name!r}: no free ticket id after {_ID_ATTEMPTS} draws")

    def hand_back(self, slot: LaneSlot) -> bool:
        """Free a running task's slot in the store (one round trip); False if its ticket is
        lost (claimed by someone else, its store data lost, or purged: this worker stalled
        past the grace): forget it, its slot is free either way."""
        ticket = slot.ticket
        try:
            self.store.retry(ticket.id, ticket.token, next_run_at=claimable_now())
        except (LeaseLost, TaskNotFound):
            logger.warning("Lane %s: ticket %d was lost", slot.lane.name, ticket.id)
            return False
        except TaskCoreError as exc:
            # its lease is no longer renewed and expires by itself; the ticket stays usable
            logger.warning("Lane %s: could not free a slot now (%s)", slot.lane.name, exc)
        return True

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


def claim_slots(
    tickets: LaneTickets, lane: Lane, waiters: Sequence[LaneWaiter], stale_secs: int
) -> list[tuple[LaneWaiter, int]]:
    """Claim slots of ``lane`` for ``waiters`` (their tickets made as needed): each waiter
    granted, with its ticket's new processing token.

    One round trip: the store's claim script recounts the lane's live leases (and, in a
    keyed lane, each key's) and claims as many candidates as there is room for, atomically.
    The lanes' generic algorithm (:func:`~celery_claims.lanes.dispatch.claim_due_for_lane`)
    lists, counts, then claims; the worker needs neither: its own waiting messages are the
    listing, and the script counts as it claims, so a count first would only cost a round
    trip on every pass with room.

    Raises:
        TaskCoreError: the lane store failed (``TaskNotFound``: a ticket it no longer has).
    """
    if not waiters:
        return []
    candidates: list[TaskClaimCandidate] = []
    for index, waiter in enumerate(waiters):
        if waiter.ticket is None:
            waiter.ticket = tickets.take_ticket(lane)
        token = waiter.ticket.token
        if token >= MAX_PROCESSING_TOKEN:
            raise InvalidValueError(TOKEN_OVERFLOW_MESSAGE)
        candidates.append(TaskClaimCandidate(index, waiter.ticket.id, token, token + 1))
    now = utc_now()
    stale = timedelta(seconds=max(stale_secs, 1))
    keyed: dict[str, Any] = {}
    if lane.spec.keyed:
        keyed = {"keys": [w.key for w in waiters], "limit_per_key": lane.spec.limit_per_key}
    claimed = tickets.store.claim_candidates_for_lane(
        lane.config, candidates, now - stale, now, now + stale, **keyed
    )
    return [(waiters[c.index], c.processing_token) for c in claimed]
