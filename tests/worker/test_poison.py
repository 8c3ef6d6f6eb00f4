"""A poison task, one that crashes its worker every time it runs, is given up visibly."""

from __future__ import annotations

import time

import pytest
import redis
from kombu import Connection

from celery_claims import AlreadyDone, GivenUp, RedisClaimManager
from tests.servers import RedisServer
from tests.worker.helpers import FAST_REDELIVERY, unique, wait_done, wait_for
from tests.worker.processes import Fleet, executions

pytestmark = pytest.mark.slow

MAX_TAKEOVERS = 2


def _start_worker(fleet: Fleet, broker: str, queue: str, *, concurrency: int) -> None:
    """Start one more worker of ``queue`` under ``MAX_TAKEOVERS`` and wait until it is ready."""
    fleet.worker(
        f"w{len(fleet.procs)}", broker=broker, backend=broker, queue=queue,
        concurrency=concurrency, extra=("--claims-max-takeovers", str(MAX_TAKEOVERS)),
    ).wait_ready()  # fmt: skip


def test_a_task_that_keeps_crashing_its_workers_is_given_up_after_the_takeover_limit(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given workers with claims_max_takeovers = 2, restarted whenever they die
    broker, queue = private_redis.url, unique("q")

    def start() -> None:
        _start_worker(fleet, broker, queue, concurrency=1)

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


def _restored_together(url: str, queue: str, count: int) -> None:
    """Restore the dead workers' unacked messages now (kombu's own scan), until ``count`` of
    them wait in ``queue``: the next worker then takes them at once, as a worker restarted
    after a crash does with its prefetch window."""
    with Connection(url, transport_options=dict(FAST_REDELIVERY)) as conn:
        client = redis.Redis.from_url(url)
        try:
            deadline = time.monotonic() + 30
            while client.llen(queue) < count:
                assert time.monotonic() < deadline, "the messages were not restored"
                conn.default_channel.qos.restore_visible(num=None, interval=1)
                time.sleep(0.2)
        finally:
            client.close()


def test_a_task_that_died_beside_a_poison_task_runs_and_is_not_given_up(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Found by the chaos soak (seed 11, CI): an innocent task, t0077, was given up as poison.
    # It had run beside the poison task in one worker; the poison task killed the worker
    # (its whole process group), both messages came back together, the next worker took
    # both and ran both, and so on: the innocent's holders died as often as the poison's.
    # Given workers of two pool processes with claims_max_takeovers = 2, and an innocent
    # task that was running when the poison task killed its worker
    broker, queue = private_redis.url, unique("q")
    claims: RedisClaimManager = fleet.claims(broker)
    client = fleet.client(broker, broker, queue)

    def start() -> None:
        _start_worker(fleet, broker, queue, concurrency=2)

    start()
    client.send_task("fleet.sleep", (4,), task_id="innocent")
    wait_for(
        lambda: [e for e in executions(broker, queue) if e["id"] == "innocent"],
        timeout=20,
        what="the innocent task's start",
    )
    client.send_task("fleet.crash_worker", task_id="poison")

    # When each dead worker's two messages come back together and the next worker takes both
    deadline = time.monotonic() + 120
    while not isinstance(claims.done_record(queue, "poison:0:0"), GivenUp):
        assert time.monotonic() < deadline, fleet.logs()
        if not any(p.alive() for p in fleet.procs):
            if claims.done_record(queue, "innocent:0:0") is None:
                _restored_together(broker, queue, 2)
            start()
        time.sleep(0.2)

    # Then the poison task is given up, and the innocent one ran to its end once: a taken-over
    # task runs alone among this worker's taken-over tasks, so it no longer dies with the
    # poison task, and a holder that died before starting it does not count
    assert isinstance(wait_done(claims, queue, "innocent:0:0", timeout=30), AlreadyDone)
    ends = [e for e in executions(broker, queue) if e["id"] == "innocent" and e["event"] == "end"]
    assert len(ends) == 1, fleet.logs()
    # (and the turns were taken: a worker got both taken-over copies and ran one at a time)
    assert "waits for this worker's other taken-over task" in fleet.logs(), fleet.logs()
