"""Signals and counters: every copy the gate does not run is visible.

Each signal is sent in the worker's main process with ``sender`` = the task object and
``request`` = the worker's ``Request``. Receivers must be quick (they run in the event loop)
and their errors are logged, never raised (Celery's ``Signal.send`` swallows them).
"""

from __future__ import annotations

import threading

from celery.utils.dispatch import Signal

__all__ = [
    "Counters",
    "claim_acquired",
    "claim_released",
    "hears_takeovers_only",
    "lane_slot",
    "plain_acquisition_heard",
    "lease_lost",
    "task_held",
    "rate_passed",
    "task_skipped",
]

#: A copy was acknowledged without running. Arguments: ``request``, ``reason`` (``"done"``,
#: ``"given_up"`` for a poison task; for a keyed task ``"key_held"``, ``"key_rescheduled"``,
#: ``"key_done"`` or ``"key_refused"``; ``"claimed"`` for a copy of a task acknowledged at
#: claim whose claim another copy's live lease holds, its publish journal entry in the store),
#: ``claim_id`` (queue/task/attempt, or queue/key),
#: ``record`` (the ``AlreadyDone`` or ``GivenUp`` record, the holder's ``AlreadyClaimed``, or
#: None), ``holder_task_id`` (the task id that held or finished the key, else None), ``key``
#: (a keyed task's key field, ``<task or namespace>[<key>]``, else ``""``) and, for
#: ``"key_refused"``, ``error`` (the :class:`~celery_claims.errors.KeyRefused`).
task_skipped = Signal(name="celery_claims.task_skipped")

#: A copy was held unacked instead of run. Arguments: ``request``, ``reason`` (``"held"`` while
#: another worker's lease is live, ``"unavailable"`` while the claim store cannot be reached,
#: ``"lane"`` while its lane is full: claimed, waiting for a slot; ``"rate"`` while a fleet-wide
#: rate is used up: claimed, waiting for its turn to start), ``claim_id``, ``holder``
#: (the other owner, or ``None``), ``recheck_s`` (next check); for ``"lane"`` also ``lane``
#: (the lane's name), ``lane_key`` (its key in a keyed lane, else ``""``) and ``instance``
#: (the fencing number of its claim); for ``"rate"`` also ``rate`` (the name of the limit that
#: waits longest, e.g. ``task:proj.send``) and ``instance``; ``key``: a keyed task's key field
#: (``claims_key``: ``<task or namespace>[<key>]``, the claim it waits for), else ``""``.
task_held = Signal(name="celery_claims.task_held")

#: A copy held for its fleet-wide rate may start now: to its lane or the pool. Arguments:
#: ``request``, ``claim_id``, ``rate`` (the limit it waited for), ``instance``.
rate_passed = Signal(name="celery_claims.rate_passed")

#: A copy that waited for its full lane got a slot and goes to the pool. Arguments:
#: ``request``, ``claim_id``, ``lane``, ``instance``.
lane_slot = Signal(name="celery_claims.lane_slot")

#: A copy's attempt ended without success and its claim was released, so a later copy runs
#: the task again. Arguments: ``request``, ``token``, ``claim_id``, ``reason`` (e.g.
#: ``"failed (ValueError)"``, ``"rejected"``, ``"revoked"``, ``"hard time limit"``, ``"not
#: started in time"``).
claim_released = Signal(name="celery_claims.claim_released")

#: A copy's claim was acquired and it goes to the pool. Arguments: ``request``, ``token``,
#: ``took_over`` (``True`` when another owner's expired lease was taken over),
#: ``previous_owner`` (that owner, else ``None``), ``claim_id``, ``waited_key`` (the key of a
#: keyed copy that was held until its key came free, else ``""``).
claim_acquired = Signal(name="celery_claims.claim_acquired")

#: A running task's lease was lost (the keeper's renewal was refused): the request is fenced,
#: its success will not be recorded as done. Arguments: ``request``, ``token``, ``error``.
lease_lost = Signal(name="celery_claims.lease_lost")


#: Receivers of :data:`claim_acquired` that act only on a takeover or a waited key, never on a
#: plain acquisition (the task history's, unless it records every acquisition), by ``id``
#: (a dead weak reference cannot be hashed): a plain acquisition that only they would hear is
#: not sent (:func:`plain_acquisition_heard`).
_takeovers_only: dict[int, object] = {}


def hears_takeovers_only(receiver: object, only: bool) -> None:
    """Say whether ``receiver`` (connected strongly to :data:`claim_acquired`) acts only on a
    takeover or a waited key (``only``), or on every acquisition."""
    if only:
        _takeovers_only[id(receiver)] = receiver
    else:
        _takeovers_only.pop(id(receiver), None)


def plain_acquisition_heard() -> bool:
    """True if a receiver of :data:`claim_acquired` may act on a plain acquisition (a claim
    neither taken over nor waited for on its key): any receiver but those of
    :func:`hears_takeovers_only`, a weakly connected one included."""
    for _, receiver in claim_acquired.receivers:  # noqa: SIM110  (no generator a message)
        if id(receiver) not in _takeovers_only:
            return True
    return False


class Counters:
    """Thread-safe event counters of one worker (``worker.claims.counters``).

    Names used by the integration: ``acquired``, ``took_over``, ``skipped_done``, ``held``
    (copies that started being held because another lease is live), ``held_unavailable``
    (copies held because the store was unreachable), ``rechecks``, ``completed``,
    ``released``, ``completion_deferred``, ``lease_lost``, ``fenced_success`` (a success not
    recorded because the lease was lost), ``renewals``, ``renew_unavailable``,
    ``unacked_refreshed``, ``revoked_released``, ``reclaimed``, ``start_timeouts``,
    ``handed_back``, ``skipped_given_up``, ``time_limit_overruns`` (running copies whose claim
    stopped being renewed at their time limit), ``master_switches``, ``records_restored``,
    ``records_restore_lost`` (Sentinel failovers, ``failover.py``); the publish journal's
    recovery counts ``journal_republished``, ``journal_dropped``, ``journal_cleared``,
    ``journal_deferred`` (its producer side counts ``journal_written`` and
    ``journal_write_failed`` in :data:`celery_claims.worker.publish.producer.PUBLISH_COUNTERS`, one
    per process); ``events_dropped`` (task history entries its writer dropped: queue full, or the
    store away too long); ``skipped_key_held``, ``rescheduled_key_held``, ``skipped_key_done``,
    ``refused_key`` (keyed tasks, ``keyed.py``); ``skipped_claimed`` (copies of a task
    acknowledged at claim acked unrun: another copy's live lease and the task's journal entry
    are its durable copy), ``held_check_failed`` (the store could not tell: held instead).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def incr(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``name``."""
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def get(self, name: str) -> int:
        """The value of counter ``name`` (0 if never counted)."""
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of every counter."""
        with self._lock:
            return dict(self._values)

    def __repr__(self) -> str:
        return f"Counters({self.snapshot()!r})"
