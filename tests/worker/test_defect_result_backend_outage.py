"""Defect: the body finished, then the result backend failed, and the task ran again.

The completion must be recorded in the claim store before (and whatever) the result backend
says: a redelivered copy of an attempt whose body returned is acked without running.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.servers import redis_server
from tests.worker.helpers import unique, wait_done, wait_for
from tests.worker.processes import Fleet, events_of, executions, unacked_task_ids

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.defects_app"

#: The broker's visibility timeout in the app (s), after which kombu restores the message.
VISIBILITY_S = 3


def test_a_task_whose_result_could_not_be_stored_is_recorded_done_and_never_runs_again(
    fleet: Fleet,
) -> None:
    # Given a worker whose broker and result backend are one Redis with AOF (every write
    # synced), its claim store on another Redis that also keeps the execution log, and a
    # task that sleeps 3 s and returns (result_backend_always_retry is off, the default)
    queue = unique("q")
    with (
        redis_server(["--appendonly", "yes", "--appendfsync", "always"]) as broker_server,
        redis_server() as store,
    ):
        broker = broker_server.url
        worker = fleet.worker(
            "a", broker=broker, backend=broker, queue=queue, concurrency=1, app=APP,
            extra=("--claims-redis-url", store.url), env={"CLAIMS_TEST_LOG": store.url},
        ).wait_ready()  # fmt: skip
        client = fleet.client(broker, broker, queue)
        client.send_task("defects.sleep", (3,), task_id="backend-down")
        wait_for(
            lambda: events_of(executions(store.url, queue), "start", "backend-down"),
            timeout=20,
            what="the task to start",
        )

        # When the broker/backend Redis crashes during the body and comes back from its AOF
        # after the body has returned (its result could not be stored)
        broker_server.stop(signal.SIGKILL)
        wait_for(
            lambda: events_of(executions(store.url, queue), "end", "backend-down"),
            timeout=20,
            what="the body to return",
        )
        time.sleep(1.0)  # the tracer tries to store the result while the backend is down
        broker_server.start()

        # Then the attempt is recorded done in the claim store
        wait_done(fleet.claims(store.url), queue, "backend-down:0:0", timeout=20)
        # ... and the message, restored by the broker after its visibility timeout, is
        # consumed without running the body again
        broker_client = fleet.redis(broker)
        time.sleep(VISIBILITY_S + 3)
        wait_for(
            lambda: (
                "backend-down" not in unacked_task_ids(broker_client)
                and broker_client.llen(queue) == 0
            ),
            timeout=20,
            what="the redelivered message to be consumed",
        )
        starts = events_of(executions(store.url, queue), "start", "backend-down")
        assert len(starts) == 1, f"the body ran {len(starts)} times: {starts}\n{fleet.logs()}"
        assert worker.alive()
