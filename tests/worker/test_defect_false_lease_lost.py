"""Defect: a store restart that lost the claim of a finished task is reported as lease lost.

The task's body returned while the claim store was down (its completion deferred); the store
comes back empty. Nothing was taken over: the completion must be recorded, no ``lease_lost``
reported, and a later copy of the task acked without running.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
from celery import Celery
from kombu.transport.redis import Channel as RedisChannel

from celery_claims import RedisClaimManager
from celery_claims.worker import signals
from tests.servers import RedisServer, redis_server
from tests.worker.helpers import (
    RENEW_INTERVAL_MS,
    close_app,
    in_process_worker,
    make_app,
    paused_task,
    unique,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_a_finished_task_whose_claim_a_store_restart_lost_is_not_reported_as_lease_lost(
    private_redis: RedisServer, key_prefix: str
) -> None:
    # Given an in-process worker whose claim store is a Redis without persistence, running a
    # task that returns only when the test lets it
    queue = unique("q")
    lost: list[Any] = []

    def on_lease_lost(sender: Any = None, request: Any = None, **_: Any) -> None:
        lost.append(getattr(request, "id", None))

    signals.lease_lost.connect(on_lease_lost, weak=False)
    with redis_server() as store:
        app: Celery = make_app(
            private_redis.url, queue=queue, claims_prefix=key_prefix, claims_redis_url=store.url
        )
        finish, paused = paused_task(app, "t.finish_while_down")

        broker = private_redis.client()
        claims = RedisClaimManager(url=store.url, prefix=key_prefix)
        task_id = unique("restart")
        try:
            with in_process_worker(app) as worker:
                result = finish.apply_async(task_id=task_id)
                assert paused.started.wait(20)

                # When the store stops just before the task returns (its completion cannot
                # be recorded) and comes back empty a few renewals later
                store.stop(signal.SIGKILL)
                paused.release.set()
                time.sleep(4 * RENEW_INTERVAL_MS / 1000)
                store.start()

                # Then nothing reports the lease as lost, and the completion is recorded again
                # once the store is back
                key = f"{task_id}:0:0"
                wait_for(
                    lambda: lost or claims.done_record(queue, key),
                    timeout=20,
                    what=f"done {key} (or lease_lost)",
                )
                time.sleep(4 * RENEW_INTERVAL_MS / 1000)
                assert task_id not in lost, "lease_lost was sent for a task that had finished"
                assert worker.claims.counters.get("lease_lost") == 0
                assert claims.done_record(queue, key) is not None
                assert result.get(timeout=10) == "done"

                # And a duplicate copy published afterwards is acked without running
                skipped = worker.claims.counters.get("skipped_done")
                finish.apply_async(task_id=task_id)
                wait_for(
                    lambda: worker.claims.counters.get("skipped_done") > skipped,
                    timeout=20,
                    what="the duplicate to be skipped as done",
                )
                wait_for(
                    lambda: broker.hlen(RedisChannel.unacked_key) == 0 and broker.llen(queue) == 0,
                    timeout=10,
                    what="the duplicate to be acked",
                )
                assert paused.runs == [task_id]
        finally:
            signals.lease_lost.disconnect(on_lease_lost)
            claims.client.close()
            broker.close()
            close_app(app)
