"""The claim store goes down mid-run: nothing runs unclaimed, nothing is lost, the worker heals."""

from __future__ import annotations

import time

import pytest

from tests.servers import RedisServer, redis_server
from tests.worker.helpers import unique, wait_done, wait_for
from tests.worker.processes import Fleet, executions

pytestmark = pytest.mark.slow

#: How long the claim store stays down (the issue's 10 s).
OUTAGE_S = 10


def test_tasks_arriving_while_the_claim_store_is_down_wait_for_it_and_then_run_once(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a prefork worker whose claim store is a separate Redis from its broker
    broker, queue = private_redis.url, unique("q")
    with redis_server() as store:
        worker = fleet.worker(
            "a", broker=broker, backend=broker, queue=queue,
            extra=("--claims-redis-url", store.url),
        ).wait_ready()  # fmt: skip
        client = fleet.client(broker, broker, queue)
        assert client.send_task("fleet.sleep", (0,), task_id="before").get(timeout=20) == 0
        # a task still running when the store goes down
        running = client.send_task("fleet.sleep", (3,), task_id="running")
        wait_for(lambda: executions(broker, queue)[1:], timeout=20, what="the running task")

        # When the claim store stops mid-run and tasks keep arriving
        store.stop()
        stopped_at = time.time()
        during = [client.send_task("fleet.sleep", (0.2,), task_id=f"during-{i}") for i in range(6)]
        time.sleep(OUTAGE_S)

        # Then none of them ran unclaimed while it was down, the running task stored no
        # result it could not verify, and the worker is still up
        assert running.state == "PENDING"
        ran = {e["id"] for e in executions(broker, queue) if e["event"] == "start"}
        assert not ran & {r.id for r in during}, "a task ran while the claim store was down"
        assert worker.alive()

        # And once the store is back (same port, empty), every one of them runs exactly once
        restarted_at = time.time()
        store.start()
        # the running task's completion is recorded (the claim is claimed again under the same
        # owner: the store came back empty) and its result stored, without running it again
        assert running.get(timeout=30) == 3
        for result in during:
            assert result.get(timeout=30) == 0.2
        starts = [e for e in executions(broker, queue) if e["event"] == "start"]
        assert sorted(e["id"] for e in starts) == sorted(
            ["before", "running", *(r.id for r in during)]
        )
        late = [e for e in starts if e["id"].startswith("during")]
        assert all(e["at"] >= restarted_at for e in late), (stopped_at, restarted_at, late)
        claims = fleet.claims(store.url)
        for result in during:
            wait_done(claims, queue, f"{result.id}:0:0")
        assert worker.alive()
        assert "claim store unavailable" in worker.output()
