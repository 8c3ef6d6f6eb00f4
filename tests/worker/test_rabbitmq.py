"""The crash takeover again with RabbitMQ as the broker (claims in a private Redis)."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest

from tests.servers import RedisServer, missing_service
from tests.worker.helpers import LEASE_MS, unique, wait_done, wait_for
from tests.worker.processes import Fleet, executions

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
        from kombu import Connection

        with Connection(RABBITMQ_URL) as conn, contextlib.suppress(Exception):
            conn.default_channel.queue_delete(queue)


def test_killing_the_holding_worker_hands_the_task_to_the_other_worker_on_rabbitmq(
    fleet: Fleet, private_redis: RedisServer, rabbitmq_queue: str
) -> None:
    # Given two prefork workers on RabbitMQ, claims in a private Redis, and a running task
    queue, store = rabbitmq_queue, private_redis.url
    for name in ("a", "b"):
        fleet.worker(
            name,
            broker=RABBITMQ_URL,
            backend=store,
            queue=queue,
            extra=("--claims-redis-url", store),
        )
    workers = {p.name: p.wait_ready() for p in fleet.procs}
    client = fleet.client(RABBITMQ_URL, store, queue)
    result = client.send_task("fleet.sleep", (4,), task_id="rabbit-1")

    def starts() -> list[dict[str, object]]:
        return [e for e in executions(store, queue) if e["event"] == "start"]

    first = wait_for(starts, timeout=20, what="the first run")[0]
    holder = str(first["worker"]).split("@")[0]

    # When the holder's whole process group is killed (RabbitMQ redelivers at once, while the
    # dead holder's lease still runs: the other worker must hold the copy, not drop it)
    workers[holder].kill_group()
    killed_at = time.monotonic()

    # Then the other worker takes over once the lease expires and finishes the task
    assert result.get(timeout=LEASE_MS / 1000 + 4 + 10) == 4
    runs = [str(r["worker"]).split("@")[0] for r in starts()]
    assert runs == [holder, ({"a", "b"} - {holder}).pop()], time.monotonic() - killed_at
    claims = fleet.claims(store)
    wait_done(claims, queue, "rabbit-1:0:0")
    assert claims.queue_stats()[queue].takeovers == 1
    survivor = workers[runs[1]].output()
    assert "is held by" in survivor, fleet.logs()
