"""Prefetch slots given back while copies wait outside the pool (held, or for a lane)."""

from __future__ import annotations

import threading
from typing import Any

from celery_claims.worker.delivery.copy import Copy

__all__ = ["SlotLedger"]


class SlotLedger:
    """Prefetch slots given back for held and lane-waiting copies, bounded by the window.

    Celery raises the prefetch count for an ETA request so the rest of the queue keeps
    flowing; a held copy does the same, but at most ``window`` of them at once (the worker's
    initial prefetch count), so one worker never pulls the whole queue into its held set.
    Copies waiting for a lane are not bounded (:meth:`give_back`).
    """

    def __init__(self) -> None:
        self.qos: Any = None
        self.window = 0
        self._given: set[int] = set()
        self._bounded: set[int] = set()
        self._lock = threading.Lock()

    def bind(self, qos: Any, window: int) -> None:
        """Use the consumer's QoS; ``window`` 0 means unbounded (no prefetch limit)."""
        with self._lock:
            self.qos = qos
            self.window = window
            self._given.clear()
            self._bounded.clear()

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

    def take_back(self, copy: Copy) -> None:
        """Take the slot given back for ``copy`` (if any) again."""
        with self._lock:
            if id(copy) not in self._given:
                return
            self._given.discard(id(copy))
            self._bounded.discard(id(copy))
        self.qos.decrement_eventually()
