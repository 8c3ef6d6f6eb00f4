"""A call handed to the consumer's event loop from another thread runs while the loop sleeps.

kombu's hub, the consumer's event loop, polls its readers for as long as its next timer
allows (up to 10 s: Celery's worker gives the hub's timer ``max_interval=10.0``). kombu 5.7
wakes the poll when another thread adds a callback; kombu 5.3 to 5.6 does not, and the
lifecycle's calls from the lease keeper waited that long (tox celery53 to celery56: a waiting
copy whose claim was taken over was readmitted seconds late).
"""

from __future__ import annotations

import socket
import threading
import types

from kombu.asynchronous import Hub
from kombu.asynchronous.timer import Timer

from celery_claims.worker.transport.loop import LoopWaker


def test_a_callback_from_another_thread_runs_while_the_loop_sleeps_in_poll() -> None:
    # Given a kombu hub built as Celery's worker builds it (its timer's max_interval 10 s),
    # looping in its own thread, with a reader that never becomes ready and a timer a minute
    # away (so each poll lasts 10 s), and a waker attached on the loop's thread, as the
    # consumer attaches it when it starts
    hub = Hub(Timer(max_interval=10.0))
    idle, _other_end = socket.socketpair()
    hub.add_reader(idle.fileno(), lambda: None)
    hub.call_later(60, lambda: None)
    consumer = types.SimpleNamespace(hub=hub, call_soon=hub.call_soon)
    waker = LoopWaker()
    ran = threading.Event()
    attached = threading.Event()

    def attach() -> None:
        waker.attach(consumer)
        attached.set()

    hub.call_soon(attach)
    loop = threading.Thread(target=hub.run_forever, daemon=True)
    loop.start()
    try:
        assert attached.wait(5), "the loop never ran its first callback"
        # When another thread hands the loop a callback (the loop is in poll by now)
        threading.Event().wait(0.3)
        waker.call_soon(consumer, ran.set)

        # Then the loop runs it at once, not after its 10 s poll
        assert ran.wait(5), "the callback waited for the loop's next timer"
    finally:
        hub.stop()  # a callback from this thread, raising kombu's Stop in the loop
        waker.call_soon(consumer, lambda: None)
        loop.join(15)
        hub.close()
        waker.close()
        idle.close()
        _other_end.close()
    assert not loop.is_alive()


def test_a_waker_polls_only_where_kombu_does_not_wake_itself_and_closes_cleanly() -> None:
    # Given a kombu hub and a waker
    hub = Hub()
    consumer = types.SimpleNamespace(hub=hub, call_soon=hub.call_soon)
    waker = LoopWaker()

    # When the waker is attached (twice, as each consumer restart does)
    waker.attach(consumer)
    waker.attach(consumer)

    # Then it adds its one reader only to a hub without a waker of its own (kombu before 5.7)
    assert len(hub.readers) == (1 if not hasattr(hub, "_waker") else 0)

    # And closed (twice: the consumer's stop is reentrant), the hub polls nothing of it, and a
    # later call is only queued, without an error
    waker.close()
    waker.close()
    assert hub.readers == {}
    waker.call_soon(consumer, lambda: None)
    hub.close()
