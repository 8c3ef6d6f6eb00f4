"""The Redis broker's restore sweep, where kombu does not run it: the gevent and eventlet pools.

A crashed worker's unacked Redis message comes back only through kombu's restore sweep, which
moves a delivery whose ``unacked_index`` score is older than ``visibility_timeout`` back to its
queue; the redelivered copy then takes the dead worker's expired claim over. kombu runs that
sweep from the worker's event loop. The gevent and eventlet pools run without one (Celery's
blocking ``synloop``), where the sweep never runs
(:func:`~celery_claims.worker.compat.restore_sweep`): without this service a crashed green
worker's task stays unacked for good, with or without claims.

:class:`RestoreSweep` runs kombu's own sweep there, on the consumer's thread (through
``consumer.call_soon``, between two polls, where kombu's loop would have run it), every
``unacked_restore_interval`` seconds. A live holder's deliveries are not restored: the lease
keeper refreshes their scores. Where the worker has an event loop (prefork, threads, solo)
kombu sweeps already and this does nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

from celery.utils.log import get_logger

from celery_claims.worker.compat import restore_sweep

__all__ = ["RestoreSweep"]

logger = get_logger("celery_claims.worker")


class RestoreSweep:
    """kombu's restore sweep for a consumer without an event loop (module docstring).

    Args:
        consumer: the worker's ``Consumer``.
    """

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self._tref: Any = None
        self._failing = False

    @property
    def running(self) -> bool:
        """True while the sweep is scheduled."""
        return self._tref is not None

    def start(self) -> bool:
        """Schedule the sweep if the consumer needs it; True if it does."""
        self.stop()
        consumer = self.consumer
        if getattr(consumer, "hub", None) is not None:
            return False  # kombu's event loop sweeps
        found = restore_sweep(getattr(consumer, "connection", None))
        if found is None:
            return False  # not the Redis broker: nothing to restore
        _, interval_s = found
        self._tref = consumer.timer.call_repeatedly(interval_s, self._due, priority=6)
        logger.info(
            "celery-claims: no event loop in this pool; running the Redis broker's restore "
            "sweep every %g s, so a crashed worker's messages come back",
            interval_s,
        )
        return True

    def stop(self) -> None:
        """Cancel the sweep (reentrant, no logging)."""
        tref, self._tref = self._tref, None
        if tref is not None:
            with contextlib.suppress(Exception):
                self.consumer.timer.cancel(tref)

    def _due(self) -> None:
        # the timer's own thread or greenlet: the sweep itself runs on the consumer's
        self.consumer.call_soon(self.sweep)

    def sweep(self) -> None:
        """Run kombu's sweep once on the consumer's current connection."""
        found = restore_sweep(getattr(self.consumer, "connection", None))
        if found is None:
            return
        try:
            found[0]()
        except Exception as exc:
            # the connection is failing: Celery's loop reconnects; try again next period
            if not self._failing:
                logger.warning("celery-claims: the restore sweep failed: %r", exc)
            self._failing = True
            return
        self._failing = False
