"""The lease keeper: one thread per worker renewing every live claim, batched per queue.

The keeper lives in the worker's main process. It is a thread rather than a timer entry
because the solo pool runs tasks inside the event loop, which would stop a timer from firing
exactly while a long task needs its lease renewed. Each beat it:

0. on a Sentinel-managed store, asks the Sentinels for the master and follows it when it
   moved (:mod:`celery_claims.worker.transport.failover`): the renewals go to the new master, a
   claim it never saw is claimed again there, and after the renewals the completion records the old
   master may have taken are written again on the new one;
1. renews every live claim with one ``renew`` round trip per (queue, lease); a refused
   renewal goes to the lifecycle, which finds out whose the task is now
   (:mod:`celery_claims.worker.delivery.verdict`) and stops the copy only if another one owns it;
2. renews the lane slots of running tasks;
3. retries completions the claim store could not take (also between beats: from
   ``claims_unavailable_retry_ms``, doubling up to ``claims_unavailable_retry_max_ms``, as
   their messages are acked only once recorded);
4. gives up copies the pool has not started within ``claims_start_timeout_ms``, and stops
   renewing copies running past their time limit (which not every pool enforces);
5. with the Redis broker, refreshes the score of every claimed or held delivery in kombu's
   ``unacked_index``, so kombu does not restore a message whose holder is alive (a dead
   holder stops refreshing, and its message is restored after ``visibility_timeout``);
6. calls the publish journal's hook
   (:meth:`~celery_claims.worker.publish.clearing.WorkerJournal.beat`: clears the entries of acked
   messages, starts a recovery scan when one is due).
7. once per lane lease, purges the lane tickets of workers that are gone
   (:meth:`~celery_claims.worker.delivery.lanes.WorkerLanes.purge_due`).

Between two beats the keeper also wakes for claims whose own lease (a per-task
``claims_lease_ms``) is too short for its period: such a claim is renewed every quarter of its
lease (:meth:`~celery_claims.worker.settings.ClaimsSettings.renew_interval_for`), and a wake
renews, in the same batches, every claim past half of its own period.

Every decision about a copy is the lifecycle's (:mod:`celery_claims.worker.delivery.lifecycle`); the
keeper only asks the store and reports.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict

from celery.utils.log import get_logger

from celery_claims.errors import BackendUnavailable
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.lifecycle import Lifecycle
from celery_claims.worker.delivery.state import State
from celery_claims.worker.runtime import ClaimsRuntime
from celery_claims.worker.transport.broker import refresh_unacked
from celery_claims.worker.transport.failover import MasterWatch

__all__ = ["STOP_GRACE_S", "Keeper"]

logger = get_logger("celery_claims.worker")

#: Seconds a stopping keeper goes on renewing claims of tasks that are still finishing
#: (a warm shutdown stops this step before the pool has drained).
STOP_GRACE_S = 600.0


class Keeper:
    """The keeper thread of one worker (see the module docstring)."""

    def __init__(self, runtime: ClaimsRuntime) -> None:
        self.runtime = runtime
        self.life: Lifecycle = runtime.life
        self.settings = runtime.settings
        self.counters = runtime.counters
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_at: float | None = None
        self._unavailable_since: float | None = None
        # the retry of completions the store could not take: when, and the delay after it
        self._records_at = math.inf
        self._records_delay_s = self.settings.unavailable_retry_ms / 1000
        # a claim acquired with a lease shorter than the period must not wait for the next beat
        self.life.wake_keeper = self._wake.set
        self.watch = MasterWatch(
            runtime.manager,
            self.life.recent,
            self.counters,
            renew_interval_ms=self.settings.renew_interval_ms,
            lease_ms=self.settings.lease_ms,
            done_ttl_ms=self.settings.done_ttl_ms,
        )

    def start(self) -> None:
        """Start the keeper thread (once)."""
        self._stop_at = None
        if self._thread is not None and self._thread.is_alive():
            return
        self._wake.clear()
        self._thread = threading.Thread(target=self._run, name="celery-claims-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the keeper to stop once no claim is left (reentrant, no logging, no blocking).

        A warm shutdown stops worker bootsteps before the pool has finished its tasks, so the
        keeper goes on renewing live claims for up to ``STOP_GRACE_S`` and then exits.
        """
        if self._stop_at is None:
            self._stop_at = time.monotonic() + STOP_GRACE_S
        self._wake.set()

    def _run(self) -> None:
        period_s = self.settings.renew_interval_ms / 1000
        next_beat = 0.0
        while True:
            stop_at = self._stop_at
            if stop_at is not None and (not self.life.reg.renewed() or time.monotonic() > stop_at):
                self.runtime.close()
                return
            now = time.monotonic()
            try:
                if now >= next_beat:
                    next_beat = now + period_s
                    self.beat()
                else:
                    self._renew(self._due(now))
            except Exception:
                logger.exception("Lease keeper beat failed")
            wait_s = min(next_beat, self._next_due(), self._records_due()) - time.monotonic()
            if self._wake.wait(max(wait_s, 0.0)):
                self._wake.clear()

    def _records_due(self) -> float:
        """When to retry the completions the store could not take (retried now if due)."""
        if not self.life.done.unwritten:
            self._records_at = math.inf
            self._records_delay_s = self.settings.unavailable_retry_ms / 1000
            return math.inf
        now = time.monotonic()
        if self._records_at == math.inf:
            self._records_at = now + self._records_delay_s  # new ones: the first delay
        elif now >= self._records_at:
            try:
                left = self.life.done.retry_unwritten()
            except Exception:
                logger.exception("Lease keeper: retrying completions failed")
                left = True
            if not left:
                return self._records_due()
            cap_s = self.settings.unavailable_retry_max_ms / 1000
            self._records_delay_s = min(self._records_delay_s * 2, cap_s)
            self._records_at = time.monotonic() + self._records_delay_s
        return self._records_at

    def _period_s(self, copy: Copy) -> float:
        return self.settings.renew_interval_for(copy.lease_ms) / 1000

    def _due(self, now: float) -> list[Copy]:
        """The claims past half of their own renew period (a wake between beats)."""
        return [
            c for c in self.life.reg.renewed() if now >= c.renew_sent_at + self._period_s(c) / 2
        ]

    def _next_due(self) -> float:
        """When the next claim with a period shorter than the keeper's must be renewed."""
        period_s = self.settings.renew_interval_ms / 1000
        return min(
            (
                c.renew_sent_at + self._period_s(c)
                for c in self.life.reg.renewed()
                if c.token is not None and self._period_s(c) < period_s
            ),
            default=math.inf,
        )

    def beat(self) -> None:
        """One keeper beat (see the module docstring)."""
        self.watch.check()
        copies = self.life.reg.renewed()
        self._renew(copies)
        self.watch.restore()
        if self.runtime.lanes is not None:
            slots = [c.lane_slot for c in copies if c.lane_slot is not None]
            self.runtime.lanes.heartbeat(slots)
        for copy in self.life.reg.copies(State.COMPLETING):
            self.life.done.complete_deferred(copy)
        now = time.monotonic()
        for copy in self.life.reg.started_late(now):
            self.life.losses.start_overdue(copy)
        for copy in self.life.reg.overran(now):
            self.life.time_limit_passed(copy)
        if self.settings.refresh_unacked:
            self.refresh_deliveries()
        if self.runtime.journal is not None:
            self.runtime.journal.beat()
        if self.runtime.lanes is not None:
            self.runtime.lanes.purge_due()

    def _renew(self, copies: list[Copy]) -> None:
        groups: dict[tuple[str, int], list[Copy]] = defaultdict(list)
        sent = time.monotonic()
        for copy in copies:
            if copy.token is not None:
                groups[(copy.token.queue_id, copy.lease_ms)].append(copy)
                # taken as sent even if the store is down: retried one period later, not
                # in a loop (the lease counts from the store's answer, later than this)
                copy.renew_sent_at = sent
        for (queue_id, lease_ms), group in groups.items():
            try:
                results = self.runtime.manager.renew(
                    queue_id, [c.token for c in group if c.token is not None], lease_ms
                )
            except BackendUnavailable as exc:
                self.counters.incr("renew_unavailable")
                if self._unavailable_since is None:
                    self._unavailable_since = time.monotonic()
                    logger.warning("Lease keeper: claim store unavailable: %s", exc)
                continue
            if self._unavailable_since is not None:
                logger.warning(
                    "Lease keeper: claim store reachable again after %.1f s",
                    time.monotonic() - self._unavailable_since,
                )
                self._unavailable_since = None
            for copy, result in zip(group, results, strict=True):
                self.life.renewal(copy, result)

    def refresh_deliveries(self) -> None:
        """Set the ``unacked_index`` score of claimed and held Redis deliveries to now."""
        deliveries = [c.delivery for c in self.life.reg.refreshed() if c.delivery is not None]
        if not deliveries:
            return
        try:
            self.counters.incr("unacked_refreshed", refresh_unacked(deliveries))
        except Exception as exc:
            logger.warning("Lease keeper: could not refresh unacked deliveries: %r", exc)
