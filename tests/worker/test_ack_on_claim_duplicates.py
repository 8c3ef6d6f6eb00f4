"""Copies of a task acked at claim that arrive while it runs (issue 31), on the Redis broker.

Such a copy finds the task claimed by a live holder. Acknowledging at claim is for tasks longer
than the broker lets a delivery stay unacked, so the copy is not held for the holder's whole
run: where the task's publish journal entry is in the store too (read in one script with the
claim), it is acked without running (skip reason ``claimed``); the lease and the entry are the
task's durable copy. On the Redis broker a message kombu restores keeps its delivery tag: the
copy acked here may share its tag with the holder's own delivery, and the holder's task must
not rest on that record. The RabbitMQ case, where a held copy brings the worker down, is in
``test_consumer_timeout.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_claims.claims.journal import RedisJournal
from celery_claims.observe import History
from tests.servers import RedisServer, redis_server
from tests.worker.helpers import wait_for
from tests.worker.processes import Fleet, Proc, events_of, executions, unacked_task_ids

#: The task's length: long enough to be running still while its copies come and go.
TASK_S = 15.0
#: Journal recovery of the workers: a message acked at claim whose holder died is published
#: again once its lease (the fleet's 3 s) has run out and this has passed.
RECOVER_AFTER_MS = 4000

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def durable_redis() -> Iterator[RedisServer]:
    """Broker and claim store of workers acking at claim: one that persists (AOF)."""
    with redis_server(extra_args=("--appendonly", "yes", "--appendfsync", "everysec")) as server:
        yield server


def start_worker(fleet: Fleet, name: str, server: RedisServer, queue: str) -> Proc:
    """A prefork -c 2 worker of ``apps/fleet.py`` acking at claim, its broker and claim store
    the same Redis."""
    extra = (
        "--claims-ack-on-claim", "true",
        "--claims-journal-recover-after-ms", str(RECOVER_AFTER_MS),
        "--claims-journal-scan-interval-ms", "500",
    )  # fmt: skip
    return fleet.worker(
        name, broker=server.url, backend=server.url, queue=queue, extra=extra
    ).wait_ready()


def skipped_reasons(client: redis.Redis, task_id: str) -> list[str]:
    """The reasons of the ``skipped`` events in ``task_id``'s task history, oldest first."""
    return [e.reason for e in History(client, "claims").read(task_id) if e.event == "skipped"]


def test_a_restored_and_a_duplicate_copy_are_acked_unrun_and_the_journal_entry_brings_the_task_back(
    fleet: Fleet, durable_redis: RedisServer, queue: str
) -> None:
    # Given a task published by a claims-aware producer (journaled), its message as kombu
    # pushed it (with its delivery tag) read off the queue before any worker takes it
    client_redis = fleet.redis(durable_redis.url)
    url = durable_redis.url
    conf = {"claims_journal_recover_after_ms": RECOVER_AFTER_MS}
    client = fleet.client(url, url, queue, plugin=True, conf=conf)
    result = client.send_task("fleet.sleep_then_apply", (TASK_S,), task_id="long-dup")
    (payload,) = client_redis.lrange(queue, 0, -1)

    # ... and a worker acking at claim that runs it (its delivery acked, gone from unacked)
    first = start_worker(fleet, "a", durable_redis, queue)
    wait_for(
        lambda: events_of(executions(url, queue), "start", "long-dup"),
        timeout=30, what="the run's start",
    )  # fmt: skip
    wait_for(lambda: not unacked_task_ids(client_redis), timeout=10, what="the ack at claim")

    # When, while it runs, the message comes back as it was, with the delivery tag the
    # holder's delivery had (what kombu's restore pushes back) and a producer publishes the
    # task again
    client_redis.lpush(queue, payload)
    client.send_task("fleet.sleep_then_apply", (TASK_S,), task_id="long-dup")

    # Then both copies are acked without running, the task claimed by a live lease with its
    # journal entry: nothing of them is left in the queue nor in unacked, and the entry stays
    wait_for(
        lambda: skipped_reasons(client_redis, "long-dup") == ["claimed", "claimed"],
        timeout=TASK_S, interval=0.2, what="both copies acked as claimed",
    )  # fmt: skip
    assert client_redis.llen(queue) == 0
    assert unacked_task_ids(client_redis) == []
    assert "long-dup:0:0" in RedisJournal(client=client_redis, prefix="claims").entries(queue)
    assert first.output().count("Task fleet.sleep_then_apply[long-dup] received") == 3

    # When the holder dies mid-task and another worker comes
    assert not events_of(executions(url, queue), "end", "long-dup"), "ended before the kill"
    first.kill_group()
    second = start_worker(fleet, "b", durable_redis, queue)

    # Then journal recovery publishes the entry again once the lease ran out, the task is
    # taken over and runs to its end once, its effect applied once, and nothing is left
    assert result.get(timeout=TASK_S * 2 + 60) == TASK_S
    log = executions(url, queue)
    assert len(events_of(log, "start", "long-dup")) == 2, log
    assert len(events_of(log, "end", "long-dup")) == 1, log
    assert int(client_redis.get(f"effects:{queue}") or 0) == 1
    assert second.alive(), fleet.logs()
    wait_for(lambda: client_redis.llen(queue) == 0, timeout=10, what="an empty queue")
    wait_for(lambda: not unacked_task_ids(client_redis), timeout=10, what="nothing unacked")


def test_a_copy_whose_task_has_no_journal_entry_is_held_until_the_holder_is_done(
    fleet: Fleet, durable_redis: RedisServer, queue: str
) -> None:
    # Given a worker acking at claim running a task, whose journal entry is gone (its holder
    # wrote it at the start: here it is removed, as a store that lost it would have)
    client_redis = fleet.redis(durable_redis.url)
    url = durable_redis.url
    client = fleet.client(url, url, queue)  # a plain producer: it journals nothing
    start_worker(fleet, "a", durable_redis, queue)
    result = client.send_task("fleet.sleep", (TASK_S / 2,), task_id="long-held")
    wait_for(
        lambda: events_of(executions(url, queue), "start", "long-held"),
        timeout=30, what="the run's start",
    )  # fmt: skip
    journal = RedisJournal(client=client_redis, prefix="claims")
    wait_for(lambda: "long-held:0:0" in journal.entries(queue), timeout=10, what="the entry")
    journal.forget(queue, ["long-held:0:0"])

    # When a copy of it comes while it runs
    client.send_task("fleet.sleep", (TASK_S / 2,), task_id="long-held")

    # Then nothing but the broker's message keeps that copy: it is held (fail closed), and
    # skipped as done once the run has ended; the task runs once
    history = History(client_redis, "claims")
    wait_for(
        lambda: any(e.event == "held" for e in history.read("long-held")),
        timeout=TASK_S, interval=0.2, what="the copy held",
    )  # fmt: skip
    assert result.get(timeout=TASK_S + 30) == TASK_S / 2
    wait_for(
        lambda: skipped_reasons(client_redis, "long-held"),
        timeout=30, interval=0.2, what="the copy skipped",
    )  # fmt: skip
    assert skipped_reasons(client_redis, "long-held") == ["done"]
    assert len(events_of(executions(url, queue), "start", "long-held")) == 1
