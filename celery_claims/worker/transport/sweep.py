"""The Redis broker's restore sweep, where kombu does not run it at the configured cadence.

A crashed worker's unacked Redis message comes back only through kombu's restore sweep, which
moves a delivery whose ``unacked_index`` score is older than ``visibility_timeout`` back to its
queue; the redelivered copy then takes the dead worker's expired claim over. kombu runs that
sweep from the worker's event loop, every ``unacked_restore_interval`` seconds, scanning on
every ``unacked_restore_throttle``-th time (kombu 5.7). Two kinds of worker miss it
(:func:`restore_cadence`):

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
(:func:`restore_mutex_expire`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kombu
from celery.utils.log import get_logger
from kombu.connection import Connection

from celery_claims.config import broker_url
from celery_claims.safety import KOMBU_DEFAULT_VISIBILITY_TIMEOUT_S

__all__ = [
    "KOMBU_RESTORE_MUTEX_EXPIRE_S",
    "RestoreCadence",
    "RestoreSweep",
    "bound_restore_lock",
    "restore_cadence",
    "restore_mutex_expire",
    "restore_visible",
]

logger = get_logger("celery_claims.worker")


#: kombu's own restore cadence before 5.7, whatever the transport options say: its event loop
#: calls the sweep every 10 s (``register_with_event_loop``) and ``QoS.restore_visible``
#: scans on every 10th call only (its ``interval=10`` default; kombu 5.3 to 5.6).
_KOMBU_FIXED_CADENCE = (10.0, 10)


@dataclass(frozen=True)
class RestoreCadence:
    """How often a worker restores dead consumers' unacked Redis messages, and who does it.

    Attributes:
        interval_s: seconds between two sweeps (the transport option
            ``unacked_restore_interval``, kombu's default 10).
        throttle: only every ``throttle``-th sweep scans ``unacked_index`` (the transport
            option ``unacked_restore_throttle``, kombu's default 10).
        kombu_loop_sweeps: True where kombu's event loop runs the sweep at this cadence
            itself: kombu 5.7 reads both options; kombu 5.3 to 5.6 read neither and sweep at
            their fixed cadence (every 10 s, scanning every 10th time: every ~100 s).
    """

    interval_s: float
    throttle: int
    kombu_loop_sweeps: bool


def restore_cadence(connection: Any) -> RestoreCadence | None:
    """The restore cadence of a Redis broker connection's transport options; None for another
    transport.

    kombu's Redis transport restores the unacked messages of dead consumers (score older than
    ``visibility_timeout`` in ``unacked_index``) from its event loop. kombu 5.7 calls
    ``MultiChannelPoller.maybe_restore_messages`` every ``unacked_restore_interval`` seconds
    and ``QoS.restore_visible`` scans on every ``unacked_restore_throttle``-th call. kombu 5.3
    to 5.6 have neither option (``Channel.from_transport_options`` drops them): their loop
    calls it every 10 s and it scans every 10th time, so a dead worker's message comes back up
    to ~100 s after its ``visibility_timeout``. A consumer without the event loop (Celery's
    ``synloop``: the gevent and eventlet pools) only tries after a poll that saw nothing,
    which never happens while ``BRPOP`` answers every ``brpop_timeout``: there the sweep never
    runs (kombu 5.3 to 5.7). Invalid values fall back as kombu 5.7's do: a non-positive
    interval to the default, a throttle of 0 to 1 (read in kombu 5.3 to 5.7).
    """
    transport = getattr(connection, "transport", None)
    if getattr(transport, "driver_type", None) != "redis":
        return None
    channel_cls = getattr(transport, "Channel", None)
    options = getattr(connection, "transport_options", None) or {}
    default_interval = getattr(channel_cls, "unacked_restore_interval", _KOMBU_FIXED_CADENCE[0])
    interval = options.get("unacked_restore_interval", default_interval)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval <= 0:
        interval = default_interval  # as kombu 5.7 does for a non-positive interval
    default_throttle = getattr(channel_cls, "unacked_restore_throttle", _KOMBU_FIXED_CADENCE[1])
    throttle = options.get("unacked_restore_throttle", default_throttle)
    if isinstance(throttle, bool) or not isinstance(throttle, (int, float)) or throttle < 0:
        throttle = default_throttle
    # kombu 5.7 scans on every call for a throttle of 0 (``interval or 1``)
    throttle = max(int(throttle), 1)
    # the options exist (and kombu's loop honours them) where the channel class declares them
    reads_options = hasattr(channel_cls, "unacked_restore_throttle")
    cadence = (float(interval), throttle)
    return RestoreCadence(
        interval_s=cadence[0],
        throttle=cadence[1],
        kombu_loop_sweeps=reads_options or cadence == _KOMBU_FIXED_CADENCE,
    )


def restore_visible(connection: Any) -> bool:
    """Scan ``unacked_index`` once now and restore what a dead consumer left (kombu's sweep,
    without its throttle); False (nothing done) where the connection has no consuming Redis
    channel yet.

    The sweep kombu's ``maybe_restore_messages`` makes: ``QoS.restore_visible`` of the first
    channel that consumes (the keys are not per channel), under kombu's cross-worker mutex
    (``unacked_mutex_key``: two workers never restore the same message twice), restoring at
    most ``unacked_restore_limit`` deliveries whose score is older than
    ``visibility_timeout``; ``interval=1`` makes it scan on this call. Touches the poller's
    ``_channels`` (read in kombu 5.3 to 5.7, where ``restore_visible(start, num, interval)``
    has the same signature).

    Raises:
        Exception: whatever the broker client raises (the caller logs it).
    """
    cycle = getattr(getattr(connection, "transport", None), "cycle", None)
    channels = getattr(cycle, "_channels", None)
    if not isinstance(channels, (set, list, tuple)):
        return False
    for channel in list(channels):
        scan: Any = getattr(getattr(channel, "qos", None), "restore_visible", None)
        if getattr(channel, "active_queues", None) and callable(scan):
            scan(num=getattr(channel, "unacked_restore_limit", None), interval=1)
            return True
    return False


#: kombu's ``unacked_mutex_expire`` (seconds): the restore sweep's cross-worker lock (5.3-5.7).
KOMBU_RESTORE_MUTEX_EXPIRE_S = 300.0


def restore_mutex_expire(url: str, options: Mapping[str, Any]) -> float | None:
    """The expiry to give the Redis broker's restore lock, or None to leave it as it is.

    kombu's restore sweep runs under a lock in the broker (``unacked_mutex``) that expires
    after ``unacked_mutex_expire``, 300 s by default. A worker killed while it holds it (in a
    sweep that restores many messages, or by a poison task that kills its process group) never
    releases it, and for the next 300 s no worker restores anything: no crashed holder's task
    is taken over, however short the visibility timeout. Bounded by the visibility timeout
    (at least 1 s, at most kombu's 300 s), a dead sweeper delays a takeover by at most one
    more visibility timeout. A sweep that outlives the lock is harmless: kombu restores each
    message in a transaction that watches ``unacked``, so two sweeps never restore one message
    twice. None where the user set the option, or the broker is not kombu's Redis transport.
    """
    if "unacked_mutex_expire" in options or not url:
        return None
    try:
        # not connected: the transport's class only
        with Connection(url) as conn:  # type: ignore[no-untyped-call]  # kombu is untyped
            driver = getattr(conn.transport, "driver_type", None)
    except Exception:  # not a URL kombu knows: the consumer itself will say so
        return None
    if driver != "redis":
        return None
    raw = options.get("visibility_timeout", KOMBU_DEFAULT_VISIBILITY_TIMEOUT_S)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return None  # refused by the startup check, which names it
    return float(min(KOMBU_RESTORE_MUTEX_EXPIRE_S, max(1.0, raw)))


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
