"""Keyed claims again with RabbitMQ as the broker (claims in a private Redis)."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import pytest
from celery.exceptions import TaskRevokedError
from kombu import Connection

from tests.lanes.intervals import max_overlap
from tests.servers import RedisServer, missing_service
from tests.worker.helpers import unique, wait_for
from tests.worker.processes import Fleet
from tests.worker.test_keyed import APP, intervals, runs, skips, started

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def rabbitmq_queue() -> Iterator[str]:
    """A queue name of this test; the queue is deleted from RabbitMQ afterwards."""
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
    except OSError:
        missing_service("RabbitMQ at 127.0.0.1:5672")
    queue = unique("q")
    try:
        yield queue
    finally:
        with Connection(RABBITMQ_URL) as conn, contextlib.suppress(Exception):
            conn.default_channel.queue_delete(queue)


def test_fifty_tasks_for_five_customers_on_rabbitmq_run_one_per_customer_and_skip_works(
    private_redis: RedisServer, fleet: Fleet, rabbitmq_queue: str
) -> None:
    # Given 2 prefork workers (-c 2) on RabbitMQ, claims and results in a private Redis
    queue, store = rabbitmq_queue, private_redis.url
    for name in ("a", "b"):
        fleet.worker(
            name,
            broker=RABBITMQ_URL,
            backend=store,
            queue=queue,
            app=APP,
            extra=("--claims-redis-url", store),
        )
    for proc in fleet.procs:
        proc.wait_ready()
    client = fleet.client(RABBITMQ_URL, store, queue)

    # When 50 tasks for 5 customers are sent two by two (c0, c0, c1, c1, ...)
    results = [
        client.send_task("keyed.sync", (f"c{(i // 2) % 5}",), {"seconds": 0.2}, task_id=f"sync-{i}")
        for i in range(50)
    ]
    done = [r.get(timeout=90) for r in results]

    # Then each ran once, one run per customer at a time, customers in parallel
    assert sorted(done) == sorted(f"sync-{i}" for i in range(50))
    by_key = intervals(runs(store, queue))
    assert sorted(len(spans) for spans in by_key.values()) == [10] * 5
    for key, spans in by_key.items():
        assert max_overlap((s, e) for s, e, _ in spans)[0] == 1, key
    assert max_overlap([(s, e) for spans in by_key.values() for s, e, _ in spans])[0] >= 2

    # And when a skip-policy task holds customer c9, another one for c9 is skipped
    holder = client.send_task("keyed.skip", ("c9",), {"seconds": 3}, task_id="skip-holder")
    wait_for(lambda: started(store, queue, "skip-holder"), timeout=20, what="the holder")
    other = client.send_task("keyed.skip", ("c9",), task_id="skip-other")
    with pytest.raises(TaskRevokedError):
        other.get(timeout=20)
    assert [(e.reason, e.other) for e in skips(store, "skip-other")] == [
        ("key_held", "skip-holder")
    ]
    assert holder.get(timeout=20) == "skip-holder"
    assert not started(store, queue, "skip-other")
    assert json.dumps("c9") in intervals(runs(store, queue))
