"""A copy whose body returned is acked only once its completion is recorded.

With the claim store apart from a Redis broker, the worker writes the completion record after
the body returns, and only then runs Celery's handler, whose ack removes the delivery from
kombu's ``unacked`` hash. Where the store cannot take the record (a partition, a paused
server), the ack must wait too: on the Redis broker a restored copy keeps its delivery tag,
so a copy that took the task over shares this one's entry in ``unacked``, and an ack sent
before the record is written may delete the live owner's message. Celery's ``task_ready``
runs at once all the same, so the worker's own books are not held up.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import state as worker_state
from kombu.transport.redis import Channel as RedisChannel

from celery_claims import RedisClaimManager
from celery_claims.worker.identity import Attempt, claim_task_id
from tests.servers import RedisServer
from tests.worker.helpers import close_app, in_process_worker, make_app, unique, wait_for

#: The worker's socket timeout on the store: the record's wait ends well inside the pause.
SOCKET_TIMEOUT_MS = 500


def retrying(app: Celery) -> Callable[..., Any]:
    """A task that asks to be retried once (a ``Retry`` is recorded as done, then acked)."""

    @app.task(shared=False, name="t.retrying", bind=True, max_retries=1, default_retry_delay=0)
    def body(self: Any, gate: str) -> str:
        if self.request.retries == 0:
            STARTED.add(gate)
            wait_for(lambda: FAULTED.get(gate), timeout=20, what="the store's fault")
            raise self.retry()
        return "retried"

    return body  # type: ignore[no-any-return]


def returning(app: Celery) -> Callable[..., Any]:
    """A task that returns once the test has paused the store; nothing can fail after its
    body (no result stored), so its pool process leaves the record to the worker."""

    @app.task(shared=False, name="t.returning", ignore_result=True)
    def body(gate: str) -> str:
        STARTED.add(gate)
        wait_for(lambda: FAULTED.get(gate), timeout=20, what="the store's fault")
        return "returned"

    return body  # type: ignore[no-any-return]


def deliveries(broker: redis.Redis, task_id: str) -> set[str]:
    """The delivery tags of ``task_id``'s messages in the Redis broker's ``unacked`` hash."""
    return {
        tag.decode()
        for tag, raw in broker.hgetall(RedisChannel.unacked_key).items()
        if json.loads(raw)[0]["headers"]["id"] == task_id
    }


#: gate name -> the store is at fault (set by the test, read by the task's body)
FAULTED: dict[str, bool] = {}
#: the gates whose task's body has started (claimed: the store answered)
STARTED: set[str] = set()


@contextlib.contextmanager
def paused(server: RedisServer) -> Iterator[None]:
    """The store answers nothing (a partition, a stopped process)."""
    with server.paused():
        yield


@contextlib.contextmanager
def refusing_writes(server: RedisServer) -> Iterator[None]:
    """The store answers, but refuses every write (``NOREPLICAS``: ``min-replicas-to-write``
    set and no replica in reach): an error reply, not an unreachable store."""
    client = server.client()
    client.config_set("min-replicas-to-write", "1")
    try:
        yield
    finally:
        client.config_set("min-replicas-to-write", "0")


@pytest.mark.parametrize("fault", [paused, refusing_writes])
@pytest.mark.parametrize("make_task", [returning, retrying], ids=["returned", "retry"])
def test_the_ack_waits_until_the_store_takes_the_completion_record(
    redis_server: RedisServer,
    private_redis: RedisServer,
    queue: str,
    key_prefix: str,
    make_task: Callable[[Celery], Callable[..., Any]],
    fault: Callable[[RedisServer], contextlib.AbstractContextManager[None]],
) -> None:
    # Given a worker on the Redis broker whose claim store is a server of its own
    app = make_app(
        redis_server.url,
        queue=queue,
        claims_prefix=key_prefix,
        claims_redis_url=private_redis.url,
        # a lease that outlasts the test, renewed at 30 s: the record is retried sooner, at
        # claims_unavailable_retry_ms (0.2 s, doubling up to 1 s)
        claims_lease_ms=90_000,
        claims_renew_interval_ms=30_000,
        claims_socket_timeout_ms=SOCKET_TIMEOUT_MS,
        # no redelivery within the test: the delivery stays in unacked until acked
        broker_transport_options={"visibility_timeout": 3600},
    )
    task = make_task(app)
    broker = redis_server.client()
    gate = unique("gate")
    try:
        with in_process_worker(app, hostname=f"{unique('w')}@localhost") as worker:
            result = task.delay(gate)
            wait_for(lambda: gate in STARTED, timeout=20, what="the body started")
            (tag,) = deliveries(broker, result.id)
            first = claim_task_id(result.id, Attempt(0, 0))
            # When the store stops answering (or taking writes) while the body runs, and the
            # body then ends
            with fault(private_redis):
                FAULTED[gate] = True
                wait_for(
                    lambda: (
                        worker.claims.counters.get("completion_deferred")
                        or tag not in deliveries(broker, result.id)
                    ),
                    timeout=20,
                    what="the record deferred (or the message acked)",
                )
                time.sleep(1.0)  # Celery's handler, had it run, has acked by now
                # Then the delivery stays in kombu's unacked hash while the record is unwritten
                assert tag in deliveries(broker, result.id), "acked before it was recorded"
                # while Celery's task_ready has run: the worker does not count it as active
                assert result.id not in {r.id for r in worker_state.active_requests}
            # And once the store answers, the record is written and the message acked, within
            # the retry's backoff, not at the keeper's next beat
            wait_for(
                lambda: tag not in deliveries(broker, result.id),
                timeout=10,
                what="the ack after the record",
            )
            store = RedisClaimManager(client=private_redis.client(), prefix=key_prefix)
            assert store.done_record(queue, first) is not None
            if make_task is retrying:
                assert result.get(timeout=30) == "retried"
    finally:
        FAULTED.pop(gate, None)
        STARTED.discard(gate)
        close_app(app)
