"""Runs of canvas parts with an in-process worker: a re-applied frozen canvas is a new run; a
copy of a run that completed (a duplicate, a late copy of an earlier run) is still skipped.

Celery's own ``test_reapplying_frozen_chord_dispatches_body_again`` (issue 30 item 11).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chain, chord, group

from celery_claims.worker import signals
from celery_claims.worker.publish.runs import RUN_HEADER
from tests.servers import RedisServer
from tests.worker.helpers import close_app, in_process_worker, make_app, wait_for

TIMEOUT = 60


class Runs:
    """Bodies run in this process, by task name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, Any]] = []

    def add(self, name: str, value: Any) -> None:
        with self.lock:
            self.seen.append((name, value))

    def of(self, name: str) -> list[Any]:
        with self.lock:
            return [v for n, v in self.seen if n == name]


@pytest.fixture
def runs() -> Runs:
    return Runs()


@pytest.fixture
def app(store_server: RedisServer, queue: str, key_prefix: str, runs: Runs) -> Iterator[Celery]:
    app = make_app(store_server.url, queue=queue, claims_prefix=key_prefix)

    @app.task(shared=False, name="t.add")
    def add(x: int, y: int) -> int:
        runs.add("add", (x, y))
        return x + y

    @app.task(shared=False, name="t.total")
    def total(values: list[int]) -> int:
        runs.add("total", values)
        return sum(values)

    @app.task(shared=False, name="t.echo")
    def echo(value: Any) -> Any:
        runs.add("echo", value)
        return value

    try:
        yield app
    finally:
        close_app(app)


@pytest.fixture
def skipped() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    def on_skipped(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    signals.task_skipped.connect(on_skipped, weak=False)
    try:
        yield seen
    finally:
        signals.task_skipped.disconnect(on_skipped)


def test_a_reapplied_frozen_chord_runs_its_header_and_body_again(app: Celery, runs: Runs) -> None:
    # Given a chord frozen once (its task ids and group id fixed), applied and finished
    add, total = app.tasks["t.add"], app.tasks["t.total"]
    canvas = chord(group(add.s(1, 2), add.s(3, 4)), total.s())
    canvas.freeze()
    with in_process_worker(app):
        assert canvas.apply_async().get(timeout=TIMEOUT) == 10

    # When it is applied again (Celery: "each apply is a new run"), with no worker running
    # while it is sent: Celery 5.7 publishes the first header part before it resets the
    # chord's state (`set_chord_size` deletes the `.c` "done" marker the first run left), so
    # a worker fast enough to report that part in between has its report dropped as a late
    # duplicate and the chord never completes, with or without claims (seen in 3 of 15 runs
    # on a loaded machine, plain Celery's race, not this package's)
    second = canvas.apply_async()

    # Then its header parts and its body run again, and the caller gets the new result
    with in_process_worker(app):
        wait_for(lambda: len(runs.of("total")) == 2, timeout=TIMEOUT, what="the body again")
        assert second.get(timeout=TIMEOUT) == 10
    assert sorted(runs.of("add")) == [(1, 2), (1, 2), (3, 4), (3, 4)]


def test_a_reapplied_frozen_group_runs_its_members_link_callbacks_again(
    app: Celery, runs: Runs
) -> None:
    # Given a group whose member has a link callback (sent by the member's trace as a message
    # of its own: no group header, no chain, as a chord's body on Celery 5.3), all frozen once
    # (the callback's id fixed too), applied and finished
    add, echo = app.tasks["t.add"], app.tasks["t.echo"]
    member, callback = add.s(1, 2), echo.s()
    callback.freeze()
    member.link(callback)
    canvas = group(member, add.s(3, 4))
    canvas.freeze()
    with in_process_worker(app):
        assert canvas.apply_async().get(timeout=TIMEOUT) == [3, 7]
        wait_for(lambda: len(runs.of("echo")) == 1, timeout=TIMEOUT, what="the callback")

        # When it is applied again
        canvas.apply_async()

        # Then the callback runs again with its member: it is of the member's new run
        wait_for(lambda: len(runs.of("echo")) == 2, timeout=TIMEOUT, what="the callback again")
        # (the other member may run after the callback: the worker is stopped only once it ran)
        wait_for(lambda: len(runs.of("add")) == 4, timeout=TIMEOUT, what="the members again")
    assert sorted(runs.of("add")) == [(1, 2), (1, 2), (3, 4), (3, 4)]


def test_a_reapplied_frozen_chain_runs_every_step_again(app: Celery, runs: Runs) -> None:
    # Given a chain of three steps, frozen once, applied and finished
    add, echo = app.tasks["t.add"], app.tasks["t.echo"]
    canvas = chain(add.s(1, 2), echo.s(), echo.s())
    canvas.freeze()
    with in_process_worker(app):
        assert canvas.apply_async().get(timeout=TIMEOUT) == 3

        # When it is applied again
        canvas.apply_async()

        # Then every step runs again (the last one carries an empty chain)
        wait_for(lambda: len(runs.of("echo")) == 4, timeout=TIMEOUT, what="the steps again")
    assert runs.of("add") == [(1, 2), (1, 2)]


def _queued_payloads(store_server: RedisServer, queue: str) -> list[bytes]:
    return list(store_server.client().lrange(queue, 0, -1))


def test_a_duplicate_of_a_completed_canvas_part_is_skipped(
    app: Celery,
    runs: Runs,
    skipped: list[dict[str, Any]],
    store_server: RedisServer,
    queue: str,
) -> None:
    # Given a group member's message, published once (a copy of its bytes kept), then run
    echo = app.tasks["t.echo"]
    result = group(echo.s("a")).apply_async()
    (payload,) = _queued_payloads(store_server, queue)
    assert RUN_HEADER.encode() in payload
    with in_process_worker(app) as worker:
        assert result.get(timeout=TIMEOUT) == ["a"]

        # When the same message arrives again (a redelivery, a journal re-publish, a retried
        # publish: the same run)
        store_server.client().lpush(queue, payload)
        wait_for(lambda: skipped, timeout=TIMEOUT, what="the skip signal")

        # Then it is acked without running
        assert runs.of("echo") == ["a"]
        assert skipped[0]["reason"] == "done"
        assert worker.claims.counters.get("skipped_done") == 1


def test_a_late_copy_of_an_earlier_run_is_skipped_after_a_later_run_completed(
    app: Celery,
    runs: Runs,
    skipped: list[dict[str, Any]],
    store_server: RedisServer,
    queue: str,
) -> None:
    # Given a frozen group applied twice, each run completed; a copy of the first run's message
    echo = app.tasks["t.echo"]
    canvas = group(echo.s("a"))
    canvas.freeze()
    first = canvas.apply_async()
    (earlier,) = _queued_payloads(store_server, queue)
    with in_process_worker(app) as worker:
        first.get(timeout=TIMEOUT)
        canvas.apply_async().get(timeout=TIMEOUT)
        wait_for(lambda: len(runs.of("echo")) == 2, timeout=TIMEOUT, what="the second run")

        # When the first run's copy arrives late (restored by the broker, say)
        store_server.client().lpush(queue, earlier)
        wait_for(lambda: skipped, timeout=TIMEOUT, what="the skip signal")

        # Then it is skipped as done: the first run completed already
        assert runs.of("echo") == ["a", "a"]
        assert worker.claims.counters.get("skipped_done") == 1


def test_a_plain_task_id_applied_twice_runs_once(
    app: Celery, runs: Runs, skipped: list[dict[str, Any]], store_server: RedisServer, queue: str
) -> None:
    # Given a plain task applied with an id of the caller's (an idempotency key): no run
    echo = app.tasks["t.echo"]
    echo.apply_async(("a",), task_id="key-1")
    (payload,) = _queued_payloads(store_server, queue)
    assert RUN_HEADER.encode() not in payload
    with in_process_worker(app):
        wait_for(lambda: runs.of("echo"), timeout=TIMEOUT, what="the first run")

        # When it is applied again with the same id
        echo.apply_async(("b",), task_id="key-1")
        wait_for(lambda: skipped, timeout=TIMEOUT, what="the skip signal")

    # Then the second is skipped as done
    assert runs.of("echo") == ["a"]
