"""The Redis broker's restore sweep, where kombu does not run it at the configured cadence.

A crashed worker's unacked Redis message comes back only through kombu's restore sweep, which
moves a delivery whose ``unacked_index`` score is older than ``visibility_timeout`` back to its
queue; the redelivered copy then takes the dead worker's expired claim over. kombu runs that
sweep from the worker's event loop, every ``unacked_restore_interval`` seconds, scanning on
every ``unacked_restore_throttle``-th time (kombu 5.7). Two kinds of worker miss it
(:func:`~celery_claims.worker.compat.restore_cadence`):

- the gevent and eventlet pools run without an event loop (Celery's blocking ``synloop``),
  where the sweep never runs: a crashed green worker's task stays unacked for good;
- kombu 5.3 to 5.6 have neither option: their loop sweeps every 10 s and scans every 10th
  time, so the message comes back up to ~100 s after its ``visibility_timeout``, whatever the
  transport options say.

:class:`RestoreSweep` runs kombu's own scan (``QoS.restore_visible``, under its cross-worker
mutex) there at kombu 5.7's cadence: on the event loop's thread from the hub's timer, as
kombu's loop does, or, without a loop, on the consumer's thread (through ``consumer.call_soon``,
between two polls). kombu's own fixed sweep still runs beside it on 5.3 to 5.6; a scan only
restores deliveries older than ``visibility_timeout``, under the mutex, so one more is
harmless. A live holder's deliveries are not restored: the lease keeper refreshes their
scores more often than ``visibility_timeout`` (the startup check says so), however often the
scan runs; a restored copy of a live holder's message is held by the gate, never acked. On
kombu 5.7 with an event loop kombu sweeps at the configured cadence and this does nothing.

Whoever sweeps, the sweep's cross-worker lock must not outlive a sweeper killed in mid-sweep
by more than a visibility timeout: :func:`bound_restore_lock` sets its expiry at start
(:func:`~celery_claims.worker.compat.restore_mutex_expire`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import kombu
from celery.utils.log import get_logger

from celery_claims.config import broker_url
from celery_claims.worker.compat import restore_cadence, restore_mutex_expire, restore_visible

__all__ = ["RestoreSweep", "bound_restore_lock"]

logger = get_logger("celery_claims.worker")


def bound_restore_lock(conf: Any) -> float | None:
    """Bound the Redis broker's restore lock by the visibility timeout in ``conf``, before the
    consumer connects, unless the user set ``unacked_mutex_expire``; the expiry set, or None.
    """
    options = conf.get("broker_transport_options", None) or {}
    if not isinstance(options, Mapping):
        return None  # refused by the startup check, which names it
    expire = restore_mutex_expire(broker_url(conf) or "", options)
    if expire is not None:
        conf.broker_transport_options = {**options, "unacked_mutex_expire": expire}
        logger.info(
            "celery-claims: the Redis broker's restore lock (unacked_mutex_expire) expires "
            "after %g s, not kombu's 300 s, so a worker killed in mid-sweep does not stop "
            "takeovers for five minutes",
            expire,
        )
    return expire


class RestoreSweep:
    """kombu's restore sweep where kombu does not run it at the configured cadence (module
    docstring).

    Args:
        consumer: the worker's ``Consumer``.
    """

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self._timer: Any = None
        self._tref: Any = None
        self._calls = 0
        self._throttle = 1
        self._failing = False

    @property
    def running(self) -> bool:
        """True while the sweep is scheduled."""
        return self._tref is not None

    def start(self) -> bool:
        """Schedule the sweep if the consumer needs it; True if it does."""
        self.stop()
        consumer = self.consumer
        cadence = restore_cadence(getattr(consumer, "connection", None))
        if cadence is None:
            return False  # not the Redis broker: nothing to restore
        hub = getattr(consumer, "hub", None)
        if hub is not None and cadence.kombu_loop_sweeps:
            return False  # kombu's event loop sweeps at this cadence
        self._calls, self._throttle = 0, cadence.throttle
        if hub is not None:
            # the hub's timer fires on the loop's thread, where kombu's own sweep runs
            self._timer = hub.timer
            self._tref = hub.timer.call_repeatedly(cadence.interval_s, self._due_in_loop)
            logger.info(
                "celery-claims: kombu %s sweeps the Redis broker's unacked messages only "
                "every ~100 s; running the restore sweep every %g s (scanning every %d), so a "
                "crashed worker's messages come back",
                kombu.__version__,
                cadence.interval_s,
                cadence.throttle,
            )
        else:
            self._timer = consumer.timer
            self._tref = consumer.timer.call_repeatedly(cadence.interval_s, self._due, priority=6)
            logger.info(
                "celery-claims: no event loop in this pool; running the Redis broker's restore "
                "sweep every %g s (scanning every %d), so a crashed worker's messages come back",
                cadence.interval_s,
                cadence.throttle,
            )
        return True

    def stop(self) -> None:
        """Cancel the sweep (reentrant, no logging)."""
        tref, self._tref = self._tref, None
        timer, self._timer = self._timer, None
        if tref is not None and timer is not None:
            with contextlib.suppress(Exception):
                timer.cancel(tref)

    def _scan_due(self) -> bool:
        # kombu's throttle (QoS.restore_visible's count): the first call scans, then every Nth
        self._calls += 1
        return (self._calls - 1) % self._throttle == 0

    def _due(self) -> None:
        # the timer's own thread or greenlet: the sweep itself runs on the consumer's
        if self._scan_due():
            self.consumer.call_soon(self.sweep)

    def _due_in_loop(self) -> None:
        if self._scan_due():
            self.sweep()

    def sweep(self) -> None:
        """Scan once on the consumer's current connection (no throttle)."""
        try:
            restore_visible(getattr(self.consumer, "connection", None))
        except Exception as exc:
            # the connection is failing: Celery's loop reconnects; try again next period
            if not self._failing:
                logger.warning("celery-claims: the restore sweep failed: %r", exc)
            self._failing = True
            return
        self._failing = False
