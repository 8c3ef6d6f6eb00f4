"""The consumer's event loop (kombu's hub): waking it from other threads, letting it go.

Read in kombu 5.3 to 5.7 (:data:`celery_claims.worker.compat.TESTED`).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from typing import Any

from kombu.asynchronous import get_event_loop, set_event_loop

__all__ = ["LoopWaker", "forget_hub_when_closed", "on_loop_soon"]


class LoopWaker:
    """Runs a callback on the consumer's event loop soon, from any thread.

    ``consumer.call_soon`` puts the callback in kombu's hub, which runs it at the top of its
    next turn. kombu 5.7's hub also wakes its poll when another thread adds one (a socket
    pair of its own, ``Hub._waker``); kombu 5.3 to 5.6's does not, so a callback added from
    the lease keeper or a thread pool's thread waits for the loop's next I/O event or timer:
    up to 10 s (Celery's worker gives the hub's timer ``max_interval=10.0``) while nothing
    arrives, for instance while the prefetch window is full. Where the hub has no waker of
    its own this one adds a socket pair as a reader of the hub (``hub.add_reader``, as
    kombu's transports register theirs) and writes a byte to it after each callback. Attach
    it from the loop's thread each time the consumer (re)starts: kombu's loop resets the
    hub, dropping every reader, when it ends.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pair: tuple[socket.socket, socket.socket] | None = None
        self._hub: Any = None

    @staticmethod
    def needed(hub: Any) -> bool:
        """True if ``hub`` is a kombu hub that does not wake itself (kombu before 5.7)."""
        return (
            hub is not None
            and not hasattr(hub, "_waker")
            and callable(getattr(hub, "add_reader", None))
            and isinstance(getattr(hub, "readers", None), dict)
        )

    def attach(self, consumer: Any) -> None:
        """Make the consumer's hub poll the waker (on the loop's thread; idempotent)."""
        hub: Any = getattr(consumer, "hub", None)
        if not self.needed(hub):
            return
        with self._lock:
            if self._pair is None:
                pair = socket.socketpair()
                for end in pair:
                    end.setblocking(False)
                self._pair = pair
            reader = self._pair[0]
        if hub.readers.get(reader.fileno()) is None:
            hub.add_reader(reader.fileno(), self._drain, reader)
        self._hub = hub

    def call_soon(self, consumer: Any, fn: Callable[..., object], *args: Any) -> None:
        """``consumer.call_soon(fn, *args)``, then wake the loop if it sleeps in poll."""
        consumer.call_soon(fn, *args)
        pair = self._pair
        if pair is not None:
            # a full socket buffer already has a wake-up pending; a closed one, no loop
            with contextlib.suppress(OSError):
                pair[1].send(b"\0")

    @staticmethod
    def _drain(reader: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while reader.recv(4096):
                pass

    def close(self) -> None:
        """Let go of the socket pair (reentrant, no logging: the consumer is stopping)."""
        with self._lock:
            pair, self._pair = self._pair, None
            hub, self._hub = self._hub, None
        if pair is None:
            return
        with contextlib.suppress(Exception):
            if hub is not None and pair[0].fileno() in hub.readers:
                hub.remove_reader(pair[0].fileno())
        for end in pair:
            end.close()


def forget_hub_when_closed(hub: Any) -> None:
    """Stop ``hub`` being the process's event loop once it is closed, as kombu 5.6 does.

    Celery's worker takes the process's event loop (``kombu.asynchronous.get_event_loop``)
    if there is one, and makes one with its own timer otherwise; its ``Hub.close`` at shutdown
    left the closed hub in place before kombu 5.6. A second worker started in the same
    process (each in-process worker of a test session) then runs on the first one's hub,
    which fires the first worker's timer, not its own: none of its timers fire (Celery's ETA
    tasks, the re-checks of held copies; found with tox celery53 to celery55). The callback
    goes in ``hub.on_close``, which ``Hub.close`` calls on every kombu from 5.3.
    """
    on_close = getattr(hub, "on_close", None)
    if isinstance(on_close, set):
        on_close.add(_forget_event_loop)


def _forget_event_loop(hub: Any) -> None:
    if get_event_loop() is hub:
        set_event_loop(None)


def on_loop_soon(
    consumer: Any, waker: LoopWaker | None, fn: Callable[..., object], *args: Any
) -> None:
    """Run ``fn(*args)`` on the consumer's event loop soon, from any thread.

    Through ``waker`` where the consumer has a hub (it wakes a loop asleep in poll on kombu
    before 5.7), the hub's own ``call_soon`` without one, and the consumer's timer where there
    is no hub (Celery's ``synloop``: the gevent and eventlet pools).
    """
    hub = getattr(consumer, "hub", None)
    if hub is not None and waker is not None:
        waker.call_soon(consumer, fn, *args)
    elif hub is not None:
        hub.call_soon(fn, *args)
    else:
        consumer.timer.call_after(0, fn, args, priority=6)
