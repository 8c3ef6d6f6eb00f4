"""A poison task, one that crashes its worker every time it runs, is given up visibly."""

from __future__ import annotations

import time

import pytest

from celery_claims import GivenUp, RedisClaimManager
from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_for
from tests.worker.processes import Fleet, executions

pytestmark = pytest.mark.slow

MAX_TAKEOVERS = 2


def test_a_task_that_keeps_crashing_its_workers_is_given_up_after_the_takeover_limit(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given workers with claims_max_takeovers = 2, restarted whenever they die
    broker, queue = private_redis.url, unique("q")

    def start() -> None:
        fleet.worker(
            f"w{len(fleet.procs)}", broker=broker, backend=broker, queue=queue, concurrency=1,
            extra=("--claims-max-takeovers", str(MAX_TAKEOVERS)),
        ).wait_ready()  # fmt: skip

    start()
    claims: RedisClaimManager = fleet.claims(broker)
    client = fleet.client(broker, broker, queue)

    # When a task that kills its worker is sent
    client.send_task("fleet.crash_worker", task_id="poison")
    deadline = time.monotonic() + 90
    while not isinstance(claims.done_record(queue, "poison:0:0"), GivenUp):
        assert time.monotonic() < deadline, fleet.logs()
        if not any(p.alive() for p in fleet.procs):
            start()
        time.sleep(0.2)

    # Then it ran once, then once per allowed takeover, and never again: the next copy was
    # acked without running, and the give-up is recorded with its count
    record = claims.done_record(queue, "poison:0:0")
    assert isinstance(record, GivenUp)
    assert record.takeovers == MAX_TAKEOVERS
    starts = [e for e in executions(broker, queue) if e["id"] == "poison"]
    assert len(starts) == MAX_TAKEOVERS + 1
    survivor = fleet.procs[-1]
    wait_for(lambda: "given up as poison" in survivor.output(), timeout=10, what="the log line")
    time.sleep(2)
    assert survivor.alive()
    assert len([e for e in executions(broker, queue) if e["id"] == "poison"]) == len(starts)
    # and the message is gone from the broker (acked), not waiting to crash a worker again
    redis = fleet.redis(broker)
    assert redis.llen(queue) == 0
    assert redis.hlen("unacked") == 0
