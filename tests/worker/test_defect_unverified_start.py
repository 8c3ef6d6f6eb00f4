"""Defect: a copy whose claim cannot be verified when the pool picks it up starts anyway.

The gate claims a copy and hands it to the pool; if the pool starts it only after its lease
could have run out and the claim store cannot be reached then, nothing says this copy still
owns the task: it must not start (fail closed), and it must not be lost either.
"""

from __future__ import annotations

import time

import pytest

from tests.servers import RedisServer, redis_server
from tests.worker.helpers import unique, wait_done, wait_for
from tests.worker.processes import Fleet, events_of, executions, paused

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.defects_app"


def test_a_copy_that_cannot_be_verified_when_the_pool_picks_it_up_waits_and_then_runs_once(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a prefork worker with one process and its claim store on a separate Redis, a
    # 5 s task L running there and a quick task T claimed and queued in the pool behind it
    # (prefetch 2, so T reaches the pool while L holds the only process, past T's lease)
    broker, queue = private_redis.url, unique("q")
    with redis_server() as store:
        assert store.proc is not None
        worker = fleet.worker(
            "a", broker=broker, backend=broker, queue=queue, concurrency=1, app=APP,
            extra=("--claims-redis-url", store.url, "--prefetch-multiplier", "2"),
        ).wait_ready()  # fmt: skip
        client = fleet.client(broker, broker, queue)
        client.send_task("defects.sleep", (5,), task_id="unverified-L")
        quick = client.send_task("defects.sleep", (0.1,), task_id="unverified-T")
        wait_for(
            lambda: events_of(executions(broker, queue), "start", "unverified-L"),
            timeout=20,
            what="L to start",
        )
        claims = fleet.claims(store.url)
        wait_for(
            lambda: claims.is_claimed(queue, "unverified-T:0:0"),
            timeout=10,
            what="T to be claimed",
        )

        # When the claim store stops answering while L still runs, and stays down until
        # a few seconds after L ended (the pool process is free for T all that time)
        with paused(store.proc.pid):
            wait_for(
                lambda: events_of(executions(broker, queue), "end", "unverified-L"),
                timeout=20,
                what="L to end",
            )
            time.sleep(3.0)
            # Then T did not start while its claim could not be verified
            assert not events_of(executions(broker, queue), "start", "unverified-T"), (
                "T started while the claim store was unreachable"
            )

        # And once the store is back T runs, exactly once
        assert quick.get(timeout=40) == 0.1, fleet.logs()
        wait_done(claims, queue, "unverified-T:0:0")
        assert len(events_of(executions(broker, queue), "start", "unverified-T")) == 1
        assert worker.alive()
