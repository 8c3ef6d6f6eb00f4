"""Two in-process workers, one after the other, in one process: the second one's timers fire.

Celery's worker takes the process's kombu event loop if there is one. Before kombu 5.6 a
stopped worker left its closed hub there, and the next worker ran on it with the first one's
timer: none of its own timers fired (ETA tasks, retries with a countdown, the re-checks of
held copies). Found with tox celery53 to celery55, where every such test after the first
in-process worker of the session timed out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu.asynchronous import get_event_loop

from tests.servers import RedisServer
from tests.worker.helpers import close_app, in_process_worker, make_app


@pytest.fixture
def app(redis_server: RedisServer, queue: str, key_prefix: str) -> Iterator[Celery]:
    app = make_app(redis_server.url, queue=queue, claims_prefix=key_prefix)

    @app.task(shared=False, name="t.later")
    def later(value: Any) -> Any:
        return value

    try:
        yield app
    finally:
        close_app(app)


def test_a_worker_started_after_another_in_the_same_process_runs_its_eta_tasks(
    app: Celery,
) -> None:
    # Given a claim-aware worker that ran and stopped in this process
    with in_process_worker(app) as first:
        assert app.tasks["t.later"].delay("first").get(timeout=20) == "first"
        first_hub = first.hub
    assert first_hub is not None

    # Then its closed hub is no longer the process's event loop
    assert get_event_loop() is not first_hub

    # And when a second worker starts and gets a task due in a second (a timer of its own)
    with in_process_worker(app) as second:
        assert second.hub is not first_hub
        result = app.tasks["t.later"].apply_async(("second",), countdown=1)

        # Then it runs the task
        assert result.get(timeout=20) == "second"
