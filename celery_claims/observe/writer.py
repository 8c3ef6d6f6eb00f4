"""The task history's writer: a thread of its own, so that no caller waits on the store.

History events are decided in the worker's event loop (the claim gate's signal receivers),
and they matter most exactly when the claim store is slow or down. Written there, each one
would hold the loop, and with it every claim, ack and Celery handler, for the store's socket
timeout. :meth:`HistoryWriter.post` only appends to a bounded queue in memory; one daemon
thread writes what is queued, one pipelined round trip per batch, in the order posted.

- A full queue drops its **oldest** event (counted: :attr:`HistoryWriter.dropped` and the
  ``on_drop`` callback, which a worker points at its ``events_dropped`` counter).
- A write that fails (store down, timed out) is retried with a growing delay, keeping only the
  newest ``keep_on_error`` events meanwhile, so an outage costs bounded memory and the
  history still tells, once the store is back, what happened while it was away.
- :meth:`HistoryWriter.stop` writes what is queued for at most its timeout, then stops the
  thread; a later :meth:`~HistoryWriter.post` starts it again (Celery may stop the worker's
  bootsteps before the pool has finished its last tasks).
- Fork-safe: a child process (a prefork pool process) gets the writer without its thread,
  its queue or its lock state; its parent writes the events it queued. The thread is started
  on the first post, so a process that records nothing never runs one.
- Interpreter exit writes what is still queued, bounded like :meth:`~HistoryWriter.stop`.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from celery_claims.errors import InvalidArgument
from celery_claims.observe.history import History, HistoryEvent, history_key, key_waiters_key

__all__ = [
    "DEFAULT_BACKOFF_MAX_S",
    "DEFAULT_BATCH_MAX",
    "DEFAULT_KEEP_ON_ERROR",
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_STOP_TIMEOUT_S",
    "HistoryWriter",
]

logger = logging.getLogger("celery_claims.observe")

#: Events kept in memory at most; beyond that the oldest is dropped.
DEFAULT_MAX_QUEUED = 10_000
#: Events written in one pipelined round trip at most.
DEFAULT_BATCH_MAX = 500
#: Events kept (the newest) while writes fail: an outage costs bounded memory.
DEFAULT_KEEP_ON_ERROR = 1_000
#: First delay after a failed write; it doubles with every failure in a row, up to the max.
DEFAULT_BACKOFF_S = 0.1
#: Longest delay between retries of a failed write.
DEFAULT_BACKOFF_MAX_S = 5.0
#: How long :meth:`HistoryWriter.stop` (and interpreter exit) may spend writing what is queued.
DEFAULT_STOP_TIMEOUT_S = 2.0

_Item = tuple[int, str, HistoryEvent]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(name, f"must be a positive int, got {value!r:.80}")
    return value


def _positive_seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgument(name, f"must be a positive number of seconds, got {value!r:.80}")
    return float(value)


class HistoryWriter:
    """Writes history events from a daemon thread; posting never blocks and never raises.

    Args:
        history: where events go.
        max_queued: events kept in memory at most (the oldest is dropped beyond).
        batch_max: events written per round trip at most.
        keep_on_error: events kept (the newest) while writes fail.
        backoff_s: first delay after a failed write (doubling per failure in a row).
        backoff_max_s: longest delay between retries.
        on_drop: called with the number of events just dropped (from any thread; it must be
            quick and must not raise).

    Raises:
        InvalidArgument: a bad history or bound.
    """

    def __init__(
        self,
        history: History,
        *,
        max_queued: int = DEFAULT_MAX_QUEUED,
        batch_max: int = DEFAULT_BATCH_MAX,
        keep_on_error: int = DEFAULT_KEEP_ON_ERROR,
        backoff_s: float = DEFAULT_BACKOFF_S,
        backoff_max_s: float = DEFAULT_BACKOFF_MAX_S,
        on_drop: Callable[[int], object] | None = None,
    ) -> None:
        if not isinstance(history, History):
            raise InvalidArgument("history", f"must be a History, got {type(history).__name__}")
        if on_drop is not None and not callable(on_drop):
            raise InvalidArgument("on_drop", f"must be callable, got {on_drop!r:.80}")
        self.history = history
        self.max_queued = _positive_int("max_queued", max_queued)
        self.batch_max = _positive_int("batch_max", batch_max)
        self.keep_on_error = min(_positive_int("keep_on_error", keep_on_error), self.max_queued)
        self.backoff_s = _positive_seconds("backoff_s", backoff_s)
        self.backoff_max_s = max(_positive_seconds("backoff_max_s", backoff_max_s), self.backoff_s)
        self.on_drop = on_drop
        self._reset()
        _live.add(self)

    def _reset(self) -> None:
        # reentrant: stop() may run in a signal handler that interrupted post() on this thread
        self._cond = threading.Condition(threading.RLock())
        self._queue: deque[_Item] = deque()
        self._in_flight: list[_Item] = []
        self._thread: threading.Thread | None = None
        self._posted = 0
        self._stopping = False
        self._stop_by = 0.0
        self._dropped = 0
        self._written = 0
        self._failures = 0

    # --- what callers use --------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Events dropped so far (the queue was full, or the store stayed away)."""
        with self._cond:
            return self._dropped

    @property
    def written(self) -> int:
        """Events written so far."""
        with self._cond:
            return self._written

    @property
    def pending(self) -> int:
        """Events posted and neither written nor dropped yet (a batch being written included)."""
        with self._cond:
            return len(self._queue) + len(self._in_flight)

    @property
    def running(self) -> bool:
        """True while this process runs the writer's thread."""
        with self._cond:
            return self._thread is not None and self._thread.is_alive()

    def post(self, task_id: str, event: HistoryEvent) -> None:
        """Queue ``event`` for the history of ``task_id``; never blocks on the store, never
        raises (a bad task id or event is logged at debug level and dropped)."""
        try:
            history_key(self.history.prefix, task_id)
            if not isinstance(event, HistoryEvent):
                raise InvalidArgument("event", f"must be a HistoryEvent, got {event!r:.80}")
            if event.key:
                # checked here: a bad one in a batch would fail every write of the batch
                key_waiters_key(self.history.prefix, event.key)
            with self._cond:
                dropped = 0
                if len(self._queue) >= self.max_queued:
                    self._queue.popleft()
                    dropped = self._count_dropped(1)
                self._posted += 1
                self._queue.append((self._posted, task_id, event))
                if self._thread is None or not self._thread.is_alive():
                    # the first event, or one after stop(): a thread that is stopping
                    # writes it before it exits, if its time allows
                    self._stopping = False
                    self._start()
                self._cond.notify_all()
            self._report_dropped(dropped)
        except Exception as exc:
            # the history is an aid: it must never disturb whoever posts (the worker's loop)
            what = getattr(event, "event", "?")
            logger.debug("celery-claims history: %s not queued: %r", what, exc)

    def flush(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> bool:
        """Wait until every event posted before this call is written (or dropped).

        Returns:
            True if so within ``timeout_s``; False if the store is still being waited for.
        """
        deadline = time.monotonic() + max(float(timeout_s), 0.0)
        with self._cond:
            target = self._posted
            while self._oldest_pending() <= target:
                left = deadline - time.monotonic()
                if left <= 0 or not (self._thread is not None and self._thread.is_alive()):
                    return False
                self._cond.wait(left)
            return True

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> bool:
        """Write what is queued for at most ``timeout_s``, then stop the thread (reentrant, no
        logging). Events the thread could not write in time are dropped (counted); a later
        :meth:`post` starts the thread again.

        Returns:
            True if everything posted was written (or there was nothing to write).
        """
        deadline = time.monotonic() + max(float(timeout_s), 0.0)
        with self._cond:
            thread = self._thread
            if thread is None or not thread.is_alive():
                return not self._queue
            self._stop_by = deadline if not self._stopping else min(self._stop_by, deadline)
            self._stopping = True
            self._cond.notify_all()
        if thread is not threading.current_thread():
            # a daemon thread stuck in a write to a hung store is left to the process's exit
            thread.join(max(deadline - time.monotonic(), 0.0))
        with self._cond:
            return not self._queue and not self._in_flight

    def __repr__(self) -> str:
        return (
            f"HistoryWriter(pending={self.pending}, written={self.written}, "
            f"dropped={self.dropped}, running={self.running})"
        )

    # --- the thread --------------------------------------------------------------------------

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="celery-claims-history", daemon=True)
        self._thread.start()

    def _oldest_pending(self) -> int:
        if self._in_flight:
            return self._in_flight[0][0]
        return self._queue[0][0] if self._queue else self._posted + 1

    def _count_dropped(self, count: int) -> int:
        self._dropped += count
        return count

    def _report_dropped(self, count: int) -> None:
        if count and self.on_drop is not None:
            try:
                self.on_drop(count)
            except Exception as exc:
                logger.debug("celery-claims history: on_drop failed: %r", exc)

    def _run(self) -> None:
        cond = self._cond
        while True:
            dropped = 0
            with cond:
                while not self._queue and not self._stopping:
                    cond.wait()
                if self._stopping and (not self._queue or time.monotonic() >= self._stop_by):
                    dropped = self._count_dropped(len(self._queue))
                    self._queue.clear()
                    self._thread = None
                    cond.notify_all()
                    break
                count = min(len(self._queue), self.batch_max)
                self._in_flight = [self._queue.popleft() for _ in range(count)]
                batch = self._in_flight
            error = self._write(batch)
            with cond:
                self._in_flight = []
                if error is None:
                    self._written += len(batch)
                    self._failures = 0
                else:
                    # back in front, in order; while the store is away keep the newest only
                    self._queue.extendleft(reversed(batch))
                    excess = len(self._queue) - self.keep_on_error
                    for _ in range(max(excess, 0)):
                        self._queue.popleft()
                    dropped = self._count_dropped(max(excess, 0))
                    self._failures += 1
                cond.notify_all()
                if error is not None:
                    delay = min(self.backoff_s * 2 ** (self._failures - 1), self.backoff_max_s)
                    if self._stopping:
                        delay = min(delay, max(self._stop_by - time.monotonic(), 0.0))
                    cond.wait(delay)
            self._report_dropped(dropped)
            if error is not None and self._failures == 1:
                logger.debug("celery-claims history: write failed, retrying: %r", error)

    def _write(self, batch: list[_Item]) -> Exception | None:
        try:
            self.history.record_many((task_id, event) for _, task_id, event in batch)
        except Exception as exc:
            return exc
        return None


#: Every writer of this process, for the fork and exit hooks.
_live: weakref.WeakSet[HistoryWriter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # the thread did not survive the fork and its lock may have been held mid-write: the
    # child starts empty (its parent writes the events it queued)
    for writer in list(_live):
        writer._reset()


def _at_exit() -> None:
    for writer in list(_live):
        writer.stop(DEFAULT_STOP_TIMEOUT_S)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)
