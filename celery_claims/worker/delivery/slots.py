"""Prefetch slots given back while copies wait outside the pool (held, for a lane, for a rate),
and the queues a worker stops taking from while a window of their copies waits for a rate."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from celery_claims.worker.delivery.copy import Copy

__all__ = ["CLOSE_AT_WINDOWS", "SlotLedger"]

#: Prefetch windows of one queue's copies waiting for their rate that close the queue (it
#: opens again at one window): as many as the worker kept before queues closed (a window
#: given back, a window in its slots), so that as many keys of a rate per key take turns.
CLOSE_AT_WINDOWS = 2


class SlotLedger:
    """Prefetch slots given back for copies that wait outside the pool.

    Celery raises the prefetch count for an ETA request so the rest of the queue keeps
    flowing; a waiting copy does the same:

    - a held copy at most ``window`` of them at once (the worker's initial prefetch count),
      so one worker never pulls the whole queue into its held set;
    - a copy waiting for a full lane without bound: the lane's limit holds fleet-wide
      whoever holds its messages (:meth:`give_back`);
    - a copy waiting for its rate without bound too, but counted per queue: once two windows
      of one queue's copies wait, the worker stops taking messages from that queue
      (``valve(queue, False)``, then :meth:`settle`), and takes them again once no more than
      one window waits (:meth:`wait_for_rate`). A limited task's backlog then stays in
      the broker while the worker's other queues keep flowing (docs/rates.md, *A backlog
      over its rate*).
    """

    def __init__(self) -> None:
        self.qos: Any = None
        self.window = 0
        self._given: set[int] = set()
        self._bounded: set[int] = set()
        #: the queue of each copy waiting for its rate, and how many wait per queue
        self._rated: dict[int, str] = {}
        self._per_queue: dict[str, int] = {}
        #: queues the worker stopped taking from
        self._closed: set[str] = set()
        self._valve: Callable[[str, bool], object] = lambda queue, open_: None
        self._lock = threading.Lock()

    def bind(
        self, qos: Any, window: int, valve: Callable[[str, bool], object] | None = None
    ) -> None:
        """Use the consumer's QoS; ``window`` 0 means unbounded (no prefetch limit).

        ``valve(queue, open)`` stops (``open`` False) or starts again taking messages from
        ``queue``. A new binding (a new connection, which consumes every queue) opens all.
        """
        with self._lock:
            self.qos = qos
            self.window = window
            if valve is not None:
                self._valve = valve
            self._given.clear()
            self._bounded.clear()
            self._rated.clear()
            self._per_queue.clear()
            self._closed.clear()

    def give_back(self, copy: Copy, *, bounded: bool = True) -> bool:
        """Give ``copy``'s prefetch slot back; True if it was (or already had been).

        ``bounded``: only while fewer than ``window`` bounded copies have theirs back. Copies
        waiting for a full lane are not bounded: the lane's limit holds fleet-wide whoever
        holds its messages, and the worker's other queues must keep flowing meanwhile.
        """
        with self._lock:
            if id(copy) in self._given:
                return True
            if self.qos is None:
                return False
            if bounded:
                if self.window and len(self._bounded) >= self.window:
                    return False
                self._bounded.add(id(copy))
            self._given.add(id(copy))
        self.qos.increment_eventually()
        return True

    def wait_for_rate(self, copy: Copy, queue: str) -> None:
        """Give back the slot of ``copy``, which waits for its rate, counted against the
        ``queue`` it came from: :data:`CLOSE_AT_WINDOWS` windows of them close it.

        Its slot always comes back: the worker's other queues keep flowing however many
        wait. What the worker holds is bounded by closing the queue instead. A copy of a
        queue being closed gives its slot back only once the consumer no longer takes from
        the queue (:meth:`settle`): a prefetch count raised before would let the broker
        send more of it. So at most two windows wait, and at most the window's slots more
        are on their way: a queue never has more than about three windows waiting in one
        worker.
        """
        with self._lock:
            if id(copy) in self._given or id(copy) in self._rated or self.qos is None:
                return
            self._rated[id(copy)] = queue
            waiting = self._per_queue[queue] = self._per_queue.get(queue, 0) + 1
            close = (
                bool(self.window)
                and waiting >= CLOSE_AT_WINDOWS * self.window
                and queue not in self._closed
            )
            if close:
                self._closed.add(queue)
            if queue in self._closed:
                valve = self._valve
            else:
                self._given.add(id(copy))
                valve = None
        if valve is None:
            self.qos.increment_eventually()
        elif close:
            valve(queue, False)

    def settle(self, queue: str) -> None:
        """The consumer stopped (or started again) taking from ``queue``: the copies of it
        that wait for their rate with their slots still taken give them back now."""
        with self._lock:
            if self.qos is None:
                return
            ready = [c for c, q in self._rated.items() if q == queue and c not in self._given]
            self._given.update(ready)
        for _ in ready:
            self.qos.increment_eventually()

    def take_back(self, copy: Copy) -> None:
        """Take the slot given back for ``copy`` (if any) again; a queue closed for its rate
        waits opens again once no more than a window of them waits."""
        if id(copy) not in self._given and id(copy) not in self._rated:
            # nothing given back for it (most copies): decided as under the lock, where a
            # give-back racing this call is found or not alike (a look-up is atomic)
            return
        with self._lock:
            queue = self._rated.pop(id(copy), None)
            given = id(copy) in self._given
            if not given and queue is None:
                return
            self._given.discard(id(copy))
            self._bounded.discard(id(copy))
            reopen = False
            if queue is not None:
                waiting = self._per_queue[queue] = self._per_queue[queue] - 1
                if not waiting:
                    del self._per_queue[queue]
                # a window apart: a queue is not closed and opened again at every start
                if queue in self._closed and waiting <= self.window:
                    self._closed.discard(queue)
                    reopen = True
            valve = self._valve
        if given:
            self.qos.decrement_eventually()
        if reopen:
            assert queue is not None
            valve(queue, True)

    def closed(self) -> set[str]:
        """The queues closed now because a window of their copies waits for a rate."""
        with self._lock:
            return set(self._closed)
