"""A worker never logs its claim store's password (masked by kombu's sanitiser)."""

from __future__ import annotations

import pytest

from tests.servers import RedisServer, free_port
from tests.worker.helpers import unique, wait_for
from tests.worker.processes import Fleet

SECRET = "s3cret-Pa55"


@pytest.mark.slow
def test_a_worker_logs_its_unreachable_store_without_the_password(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a worker whose claim store URL carries a password and is unreachable at start
    broker, queue, port = private_redis.url, unique("q"), free_port()
    store = f"redis://127.0.0.1:{port}/0?password={SECRET}"
    worker = fleet.worker("m", broker=broker, backend=broker, queue=queue,
                          extra=("--claims-redis-url", store)).wait_ready()  # fmt: skip

    # When a task arrives (and is held: its claim cannot be taken)
    fleet.client(broker, broker, queue).send_task("fleet.sleep", (0,))
    wait_for(lambda: "claim store unavailable" in worker.output(), timeout=20, what="the hold")

    # Then the worker named the store in its log, never with the password
    output = worker.output()
    assert f"the claim store at redis://127.0.0.1:{port}/0 is unreachable at start" in output
    assert SECRET not in output
