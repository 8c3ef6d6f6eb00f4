"""Tasks longer than SQS's visibility timeout (issue 31), on a private moto server.

SQS hides a received message for the queue's visibility timeout and shows it again if it was
not deleted by then. kombu creates the queue with the ``visibility_timeout`` transport option
(30 minutes by default) and never extends it while a task runs, so with ``task_acks_late`` a
longer task's message is received again, and runs again, while the first run goes on. With
celery-claims the task runs once, but the message is received again at every timeout and each
copy is held (unacked) until the run ends, unless the worker acknowledges at claim
(``claims_ack_on_claim``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_claims.observe import History
from tests.servers import MotoServer, RedisServer, redis_server
from tests.worker.helpers import wait_for
from tests.worker.processes import Fleet, Proc, events_of, executions

#: The queue's visibility timeout, in seconds (SQS counts whole seconds).
VISIBILITY_TIMEOUT_S = 5
#: Each task runs three times longer than that.
TASK_S = 3 * VISIBILITY_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.sqs, pytest.mark.timeout(240)]


def transport_options(sqs: MotoServer) -> dict[str, Any]:
    """kombu's SQS options: the moto server, the short visibility timeout, quick polls."""
    return {
        **sqs.transport_options,
        "visibility_timeout": VISIBILITY_TIMEOUT_S,
        "polling_interval": 0.5,
        "wait_time_seconds": 1,
    }


def test_plain_celery_runs_a_task_again_while_it_outlives_the_visibility_timeout_on_sqs(
    fleet: Fleet, private_sqs: MotoServer, private_redis: RedisServer, queue: str
) -> None:
    # Given a plain Celery worker (acks_late, prefork -c 2) on SQS whose messages stay
    # hidden 5 s after they are received
    options = transport_options(private_sqs)
    conf = {"broker_transport_options": options}
    fleet.worker(
        "a",
        broker=private_sqs.url,
        backend=private_redis.url,
        queue=queue,
        plugin=False,
        env={"CLAIMS_TEST_CONF": json.dumps(conf)},
    ).wait_ready()
    client = fleet.client(private_sqs.url, private_redis.url, queue, conf=conf)

    # When it runs a task three times longer than that
    result = client.send_task("fleet.sleep", (TASK_S,), task_id="long-1")

    def runs(event: str, count: int) -> list[dict[str, Any]]:
        entries = events_of(executions(private_redis.url, queue), event, "long-1")
        return entries if len(entries) >= count else []

    # Then the message shows again once the visibility timeout has passed, and the task runs a
    # second time beside the first run (kombu never extends the timeout)
    starts = wait_for(lambda: runs("start", 2), timeout=TASK_S + 30, what="a second run")
    assert result.get(timeout=TASK_S + 30) == TASK_S
    ends = wait_for(lambda: runs("end", 2), timeout=TASK_S + 30, what="the second run's end")
    assert starts[1]["at"] - starts[0]["at"] >= VISIBILITY_TIMEOUT_S - 1, starts
    assert starts[1]["at"] < ends[0]["at"], (starts, ends)


@pytest.fixture
def durable_redis() -> Iterator[RedisServer]:
    """The claim store of a worker acking at claim: one that persists (AOF), as it requires."""
    with redis_server(extra_args=("--appendonly", "yes")) as server:
        yield server


def _acking_at_claim(fleet: Fleet, sqs: MotoServer, store: str, queue: str) -> tuple[Proc, Celery]:
    """A worker acking at claim on ``sqs`` (claims in ``store``), ready, and a claims-aware
    producer."""
    conf = {"broker_transport_options": transport_options(sqs)}
    worker = fleet.worker(
        "a",
        broker=sqs.url,
        backend=store,
        queue=queue,
        extra=("--claims-redis-url", store, "--claims-ack-on-claim", "true"),
        env={"CLAIMS_TEST_CONF": json.dumps(conf)},
    ).wait_ready()
    client = fleet.client(
        sqs.url, store, queue, plugin=True, conf={**conf, "claims_redis_url": store}
    )
    return worker, client


def test_claims_worker_acking_at_claim_takes_a_task_longer_than_the_timeout_off_sqs_once(
    fleet: Fleet, private_sqs: MotoServer, durable_redis: RedisServer, queue: str
) -> None:
    # Given a worker with celery-claims acking at claim (claims in a private Redis) on SQS
    # whose messages stay hidden 5 s after they are received, and a claims-aware producer
    store = durable_redis.url
    worker, client = _acking_at_claim(fleet, private_sqs, store, queue)

    # When it runs a task three times longer than that
    result = client.send_task("fleet.sleep", (TASK_S,), task_id="long-1")

    # Then the task runs once, its message is received once: deleted when the claim is taken,
    # not shown again at every timeout and held (without claims_ack_on_claim it is received
    # three times in 15 s), and the queue ends empty
    assert result.get(timeout=TASK_S + 30) == TASK_S
    log = executions(store, queue)
    assert len(events_of(log, "start", "long-1")) == 1, log
    assert worker.output().count("Task fleet.sleep[long-1] received") == 1, fleet.logs()
    assert wait_for(lambda: private_sqs.messages(queue) == (0, 0), timeout=10)


def test_a_duplicate_of_a_task_acked_at_claim_is_deleted_unrun_while_it_runs_on_sqs(
    fleet: Fleet, private_sqs: MotoServer, durable_redis: RedisServer, queue: str
) -> None:
    # Given a worker acking at claim on SQS (messages hidden 5 s once received), running a
    # task three times longer than that, published by a claims-aware producer
    store = durable_redis.url
    worker, client = _acking_at_claim(fleet, private_sqs, store, queue)
    result = client.send_task("fleet.sleep", (TASK_S,), task_id="long-dup")
    wait_for(
        lambda: events_of(executions(store, queue), "start", "long-dup"),
        timeout=30, what="the run's start",
    )  # fmt: skip

    # When the producer publishes the same task again while it runs
    client.send_task("fleet.sleep", (TASK_S,), task_id="long-dup")

    # Then the duplicate is deleted without running as soon as it is received, its task
    # claimed by a live lease with its journal entry (not held, shown again at every
    # visibility timeout and skipped once the run ends); the task runs once; the queue ends
    # empty
    history = History(durable_redis.client(), "claims")
    wait_for(
        lambda: [e.reason for e in history.read("long-dup") if e.event == "skipped"],
        timeout=TASK_S, interval=0.2, what="the duplicate acked",
    )  # fmt: skip
    assert result.get(timeout=TASK_S + 30) == TASK_S
    assert [e.reason for e in history.read("long-dup") if e.event == "skipped"] == ["claimed"]
    log = executions(store, queue)
    assert len(events_of(log, "start", "long-dup")) == 1, log
    assert worker.output().count("Task fleet.sleep[long-dup] received") == 2, fleet.logs()
    assert wait_for(lambda: private_sqs.messages(queue) == (0, 0), timeout=10)
