"""Defect: a failed task ran again when its worker died before its next keeper beat.

A worker clears the publish journal entry of each message it acks for good, batched per
keeper beat. A task that failed (Celery acks a failed ``acks_late`` task: it is over) leaves
no completion record, so if its worker dies between the ack and the beat, the entry stays,
and journal recovery later finds it neither done nor claimed and publishes it again: the
failed task runs a second time. The same holds for a revoked task and for a copy skipped
under a keyed claim's ``skip`` policy. An attempt that ends without a record now has its
entry cleared when it is acked, not at the next beat.
"""

from __future__ import annotations

import json
import signal
import threading
from typing import Any

import pytest
import redis as redis_lib

from celery_claims.claims.journal import RedisJournal
from tests.servers import RedisServer
from tests.worker.helpers import FAST_JOURNAL, unique, wait_for
from tests.worker.processes import Fleet, events_of, executions, unacked_task_ids

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.defects_app"

JOURNAL = FAST_JOURNAL


def test_a_failed_task_is_not_run_again_when_its_worker_dies_after_the_ack(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a worker whose keeper beats every 20 s (no beat between a failure and a kill),
    # and a claims-aware producer
    broker, queue = private_redis.url, unique("q")
    env = {"CLAIMS_TEST_CONF": json.dumps(JOURNAL)}
    slow_beat = ("--claims-lease-ms", "60000", "--claims-renew-interval-ms", "20000")
    first = fleet.worker(
        "a", broker=broker, backend=broker, queue=queue, concurrency=1, app=APP, env=env,
        extra=slow_beat,
    ).wait_ready()  # fmt: skip
    client = fleet.client(broker, broker, queue, plugin=True, conf=JOURNAL)
    redis = fleet.redis(broker)

    # When a task fails, is acked, and its worker dies before its next beat
    client.send_task("defects.fail", task_id="failed-once")
    wait_for(
        lambda: (
            events_of(executions(broker, queue), "start", "failed-once")
            and not redis.llen(queue)
            and "failed-once" not in unacked_task_ids(redis)
        ),
        timeout=20,
        what="the failed task to be acked",
    )
    first.kill_group(signal.SIGKILL)
    first.popen.wait(timeout=10)

    # Then another worker, once journal recovery could have acted, has not run it again
    second = fleet.worker(
        "b", broker=broker, backend=broker, queue=queue, concurrency=1, app=APP, env=env
    )
    wait_for(
        lambda: not redis.keys("claims:{*}:j"),
        timeout=40,
        what="no journal entry left for the failed task",
    )
    starts = events_of(executions(broker, queue), "start", "failed-once")
    assert len(starts) == 1, f"the failed task ran {len(starts)} times" + second.output()[-6000:]


def journaling_worker(fleet: Fleet, broker: str, queue: str) -> tuple[Any, redis_lib.Redis]:
    """A prefork worker (Celery schedules its acks on the event loop) with fast journal
    recovery, started; returns a claims-aware producer and a client of the broker."""
    env = {"CLAIMS_TEST_CONF": json.dumps(JOURNAL)}
    fleet.worker(
        "a", broker=broker, backend=broker, queue=queue, concurrency=1, app=APP, env=env
    ).wait_ready()
    return fleet.client(broker, broker, queue, plugin=True, conf=JOURNAL), fleet.redis(broker)


def test_a_failed_tasks_journal_entry_is_cleared_by_its_prefork_worker(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a prefork worker (Celery schedules its acks on the event loop) and a claims-aware
    # producer
    broker, queue = private_redis.url, unique("q")
    client, redis = journaling_worker(fleet, broker, queue)

    # When a task fails and is acked
    client.send_task("defects.fail", task_id="failed-live")

    # Then its journal entry goes, and recovery never publishes it again (before the fix the
    # entry stayed until recovery had re-published it claims_journal_max_republish times)
    wait_for(
        lambda: (
            events_of(executions(broker, queue), "start", "failed-live")
            and not redis.keys("claims:{*}:j")
        ),
        timeout=40,
        what="the failed task's journal entry to go",
    )
    assert len(events_of(executions(broker, queue), "start", "failed-live")) == 1


def test_a_failed_tasks_journal_entry_is_cleared_before_its_message_is_acked(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # The first test above SIGKILLs the worker right after the ack: it failed in a loaded CI
    # rehearsal (the task ran twice), because the entry was cleared only after the ack, and a
    # worker killed in between left it for recovery. Cleared first, a worker killed between
    # the two leaves the message unacked instead: the broker's own redelivery, at least once.
    # Given a prefork worker and a claims-aware producer, every command the server gets seen
    broker, queue = private_redis.url, unique("q")
    client, redis = journaling_worker(fleet, broker, queue)
    forget_sha = RedisJournal(client=redis).scripts["journal_forget"].sha
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        with fleet.redis(broker).monitor() as monitor:
            while not stop.is_set():
                seen.append(monitor.next_command()["command"])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    redis.ping()
    wait_for(lambda: seen, timeout=10, what="MONITOR to see a command")
    try:
        # When a task fails and is acked
        client.send_task("defects.fail", task_id="failed-order")
        wait_for(
            lambda: not redis.keys("claims:{*}:j") and not redis.hlen("unacked"),
            timeout=30,
            what="the failed task acked and its entry cleared",
        )
    finally:
        stop.set()
        redis.ping()  # one more command, so the watcher's read returns
        watcher.join(timeout=10)

    # Then the entry's removal reached the server before the ack did
    forget = next(i for i, c in enumerate(seen) if c.startswith(f"EVALSHA {forget_sha}"))
    ack = next(i for i, c in enumerate(seen) if c.startswith("HDEL unacked "))
    assert forget < ack, seen[min(forget, ack) : max(forget, ack) + 1]
