"""``claim_acquired`` reaches every receiver that acts on it, and only those are sent it.

A plain acquisition (neither taken over nor waited for on a key) is sent only where a receiver
acts on it: the task history, by default, records takeovers and waited keys alone, so a worker
with nothing else connected builds no arguments for it. In-process workers on a private Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_claims.observe import History
from celery_claims.worker import signals
from celery_claims.worker.history import (
    attach_history,
    connect_history,
    history_connected,
    stop_history,
)
from tests.servers import RedisServer
from tests.worker.helpers import close_app, in_process_worker, make_app, wait_done, wait_for


@pytest.fixture
def app(store_server: RedisServer, queue: str, key_prefix: str) -> Iterator[Celery]:
    app = make_app(store_server.url, queue=queue, claims_prefix=key_prefix)

    @app.task(shared=False, name="t.plain")
    def plain(value: Any) -> Any:
        return value

    try:
        yield app
    finally:
        close_app(app)


@pytest.fixture
def history(app: Celery, store_server: RedisServer, key_prefix: str) -> Iterator[History]:
    """The task history of the app's in-process workers (``worker_ready`` is not sent)."""
    history = History(store_server.client(), key_prefix)
    attach_history(app, history)
    try:
        yield history
    finally:
        stop_history(app)
        connect_history()  # the default again: takeovers and waited keys only


def _events(history: History, task_id: str) -> list[str]:
    return [event.event for event in history.read(task_id)]


def test_a_plain_acquisition_is_recorded_once_the_history_is_asked_to_after_it_was_connected(
    app: Celery, history: History, queue: str
) -> None:
    # Given the task history, connected by install(app) without record_acquired, then asked
    # to record every acquisition
    assert history_connected()
    connect_history(record_acquired=True)

    # When a task runs
    with in_process_worker(app) as worker:
        assert app.tasks["t.plain"].apply_async((1,), task_id="plain-1").get(timeout=10) == 1
        wait_done(worker.claims.manager, queue, "plain-1:0:0")

        # Then its acquisition is in its history
        wait_for(
            lambda: "acquired" in _events(history, "plain-1"),
            timeout=10,
            what="the acquired event",
        )


def test_a_plain_acquisition_is_neither_recorded_nor_sent_for_the_default_history_alone(
    app: Celery, history: History, queue: str
) -> None:
    # Given the default task history, the only receiver of claim_acquired
    assert signals.claim_acquired.receivers
    assert not signals.plain_acquisition_heard()

    # When two tasks run
    with in_process_worker(app) as worker:
        assert app.tasks["t.plain"].apply_async((1,), task_id="quiet-1").get(timeout=10) == 1
        wait_done(worker.claims.manager, queue, "quiet-1:0:0")
        assert app.tasks["t.plain"].apply_async((2,), task_id="quiet-2").get(timeout=10) == 2
        wait_done(worker.claims.manager, queue, "quiet-2:0:0")

        assert worker.claims.counters.get("acquired") == 2

    # Then, all the history held written, nothing of their acquisitions is in it
    assert stop_history(app, timeout_s=5)
    assert _events(history, "quiet-1") == []
    assert _events(history, "quiet-2") == []


def test_a_receiver_of_the_users_hears_every_plain_acquisition_beside_the_history(
    app: Celery, history: History, queue: str
) -> None:
    # Given a receiver of the user's, weakly connected, beside the default task history
    heard: list[tuple[str, bool]] = []

    class Listener:
        def on_acquired(self, request: Any = None, took_over: bool = False, **_: Any) -> None:
            heard.append((request.id, took_over))

    listener = Listener()
    signals.claim_acquired.connect(listener.on_acquired)
    try:
        assert signals.plain_acquisition_heard()

        # When a task runs
        with in_process_worker(app) as worker:
            assert app.tasks["t.plain"].apply_async((1,), task_id="heard-1").get(timeout=10) == 1
            wait_done(worker.claims.manager, queue, "heard-1:0:0")

        # Then the receiver heard its acquisition
        assert heard == [("heard-1", False)]
    finally:
        signals.claim_acquired.disconnect(listener.on_acquired)
    assert not signals.plain_acquisition_heard()


def test_a_dead_weak_receiver_counts_as_heard_until_celery_clears_it() -> None:
    # Given a receiver connected weakly, then gone
    def receiver(**_: Any) -> None:
        pass

    signals.claim_acquired.connect(receiver)
    del receiver

    # Then asking whether a plain acquisition is heard does not raise (a dead weak reference
    # cannot be hashed)
    assert signals.plain_acquisition_heard() in (True, False)
