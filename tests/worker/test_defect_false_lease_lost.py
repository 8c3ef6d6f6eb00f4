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


def test_a_running_task_whose_store_holds_only_an_earlier_owners_expired_claim_keeps_running(
    private_redis: RedisServer, key_prefix: str
) -> None:
    # Given an in-process worker running a task it took over, and a claim store that then
    # holds only the earlier owner's expired claim of it: what a Sentinel failover leaves when
    # the takeover reached the old master after the replica's last sync
    queue = unique("q")
    app: Celery = make_app(private_redis.url, queue=queue, claims_prefix=key_prefix)
    finish, paused = paused_task(app, "t.finish_after_failover")
    claims = RedisClaimManager(url=private_redis.url, prefix=key_prefix)
    task_id = unique("failover")
    key = f"{task_id}:0:0"
    try:
        with in_process_worker(app) as worker:
            result = finish.apply_async(task_id=task_id)
            assert paused.started.wait(20)
            for _ in range(5):  # should the keeper renew in between, it claims it again
                (ours,) = claims.list_claims(queue)
                claims.release(ours)
                if claims.claim(queue, key, "earlier-host/1/attempt", 0).acquired:
                    break
            assert claims.is_claimed(queue, key) is None
            assert claims.get_token(queue, key, ours.owner) is None

            # When the keeper's renewal is refused a few times over, then the task returns
            time.sleep(4 * RENEW_INTERVAL_MS / 1000)
            paused.release.set()

            # Then the task was never stopped as lease lost: the copy claimed it again, its
            # result is stored and its completion recorded under its own owner
            assert result.get(timeout=20) == "done"
            record = wait_for(
                lambda: claims.done_record(queue, key), timeout=10, what=f"done {key}"
            )
            assert record.owner == ours.owner
            assert worker.claims.counters.get("lease_lost") == 0
            assert worker.claims.counters.get("reclaimed") >= 1
            assert paused.runs == [task_id]
    finally:
        claims.client.close()
        close_app(app)
