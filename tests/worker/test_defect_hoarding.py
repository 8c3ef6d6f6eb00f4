"""Defect: copies held while the claim store is down are not bounded per worker.

A copy the gate cannot claim is kept unacked and re-checked; if holding it also makes room
for the next message, a worker goes on taking messages from the broker for as long as the
store is down, and the rest of the fleet cannot run them.
"""

from __future__ import annotations

import collections
import json
import signal
import time

import pytest
from kombu.transport.redis import Channel as RedisChannel

from tests.servers import RedisServer, redis_server
from tests.worker.helpers import unique, wait_for
from tests.worker.processes import Fleet, executions

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.defects_app"
TASKS = 40
#: prefork -c 2 with worker_prefetch_multiplier 1
WINDOW = 2
OUTAGE_S = 4.0


def test_a_worker_takes_at_most_twice_its_window_from_the_broker_while_the_store_is_down(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a worker (prefork, 2 processes, window 2) whose claim store is a separate Redis,
    # and 40 short tasks flowing through it
    broker, queue = private_redis.url, unique("q")
    with redis_server() as store:
        worker = fleet.worker(
            "a", broker=broker, backend=broker, queue=queue, concurrency=WINDOW, app=APP,
            extra=("--claims-redis-url", store.url),
        ).wait_ready()  # fmt: skip
        client = fleet.client(broker, broker, queue)
        results = [
            client.send_task("defects.sleep", (0.3,), task_id=f"hoard-{i}") for i in range(TASKS)
        ]
        wait_for(
            lambda: len([e for e in executions(broker, queue) if e["event"] == "end"]) >= 2,
            timeout=30,
            what="the first tasks to run",
        )
        broker_client = fleet.redis(broker)

        # When the claim store goes down for a few seconds (and comes back empty) while the
        # broker is polled
        seen: list[tuple[int, int, int]] = []
        store.stop(signal.SIGKILL)
        deadline = time.monotonic() + OUTAGE_S
        while time.monotonic() < deadline:
            pipe = broker_client.pipeline(transaction=True)
            pipe.hlen(RedisChannel.unacked_key)
            pipe.llen(queue)
            pipe.lrange(f"executions:{queue}", 0, -1)
            unacked, queued, log = pipe.execute()
            ended = sum(1 for raw in log if json.loads(raw)["event"] == "end")
            seen.append((unacked, queued, ended))
            time.sleep(0.05)
        store.start()

        # Then the worker never held more than twice its window of messages unacked, and the
        # queue kept the rest
        assert seen
        worst = max(seen)
        assert worst[0] <= 2 * WINDOW, (
            f"the worker took {worst[0]} messages from the broker during the outage "
            f"(unacked, queued, ended) = {worst}"
        )
        for unacked, queued, ended in seen:
            assert queued >= TASKS - 2 * WINDOW - ended, (unacked, queued, ended)

        # And once the store is back every task runs exactly once
        for result in results:
            assert result.get(timeout=60) == 0.3
        starts = collections.Counter(
            e["id"] for e in executions(broker, queue) if e["event"] == "start"
        )
        assert starts == {f"hoard-{i}": 1 for i in range(TASKS)}, starts
        assert worker.alive()
