"""A body that returned is not run again when its worker's main process stops before the ack.

With the claim store on the Redis broker, the worker's ack writes the completion record in the
same script that removes the delivery (``ack_done.lua``). The ack comes from the main process,
after the pool process has handed it the result; a main process paused past the lease (a GC
pause, a frozen VM) at that moment used to let the message be restored and another worker run
the finished task again. The pool process now writes the record before the result leaves it:
with the store on the broker it settles the copy (record and delivery removal in one script),
with a store apart it records it and the worker acks without a write of its own.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from celery_claims import RedisClaimManager
from celery_claims.worker.transport.sender import ScriptSender
from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_done, wait_for
from tests.worker.processes import Fleet, events_of, executions, unacked_task_ids

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.defects_app"


@pytest.fixture(params=["store on the broker", "store apart"])
def store_url(request: pytest.FixtureRequest, private_redis: RedisServer) -> Iterator[str]:
    """The claim store: the broker's own server (the ack writes the record) or a server of
    its own (the worker writes it on its pipe before the ack)."""
    if request.param == "store on the broker":
        yield private_redis.url
        return
    store = RedisServer().start()
    try:
        yield store.url
    finally:
        store.cleanup()


def test_a_finished_task_whose_main_process_stops_before_the_ack_is_not_run_again(
    fleet: Fleet, private_redis: RedisServer, store_url: str
) -> None:
    # Given two prefork workers on a Redis broker, with the claim store on it or apart
    broker, queue = private_redis.url, unique("q")
    workers = {
        name: fleet.worker(
            name,
            broker=broker,
            backend=broker,
            queue=queue,
            concurrency=1,
            app=APP,
            extra=("--claims-redis-url", store_url),
        ).wait_ready()
        for name in "ab"
    }
    client = fleet.client(broker, broker, queue)
    task_id = unique("ahead")

    # When a task's body stops its worker's main process and returns
    client.send_task("defects.pause_parent", task_id=task_id)
    end = wait_for(
        lambda: events_of(executions(broker, queue), "end", task_id),
        timeout=20,
        what="the body to return",
    )[0]
    holder = workers[end["worker"].split("@")[0]]
    try:
        # Then, once the lease and the visibility timeout have run out and the message was
        # restored to the other worker, that copy is skipped: the task is recorded done and
        # its message leaves the broker
        claims = fleet.claims(store_url)
        wait_done(claims, queue, f"{task_id}:0:0", timeout=30)
        redis = fleet.redis(broker)
        wait_for(
            lambda: task_id not in unacked_task_ids(redis) and redis.llen(queue) == 0,
            timeout=30,
            what="the restored copy to be skipped and acked",
        )
        starts = events_of(executions(broker, queue), "start", task_id)
        assert [s["pid"] for s in starts] == [end["pid"]], "the finished task ran again"
    finally:
        os.kill(holder.popen.pid, signal.SIGCONT)


def test_a_record_sent_ahead_loads_its_script_on_a_fresh_store_and_after_a_flush(
    private_redis: RedisServer,
) -> None:
    # Given a store that has never seen the release script, and a pool process's sender
    manager = RedisClaimManager(url=private_redis.url, prefix=unique("p"))
    manager.client.script_flush()
    errors: list[BaseException] = []
    sender = ScriptSender(lambda reply, error: errors.append(error) if error else None)
    try:

        def record(task: str) -> bool:
            token = manager.claim("q", task, "a@host/1/n.1", 60_000).token
            assert token is not None
            sender.send(manager.client, manager.complete_call(token, 60_000))
            return wait_for(
                lambda: manager.done_record("q", task) is not None, timeout=5, what=task
            )

        # When records are sent without waiting for their replies, Then the first is written
        assert record("first:0:0")
        # and after SCRIPT FLUSH, the record that met NOSCRIPT is the ack's to write, and the
        # sender loads the script again for the next one
        manager.client.script_flush()
        token = manager.claim("q", "lost:0:0", "a@host/1/n.2", 60_000).token
        assert token is not None
        sender.send(manager.client, manager.complete_call(token, 60_000))
        assert sender.drain(timeout_s=5) == 0
        assert [type(e).__name__ for e in errors] == ["NoScriptError"]
        assert record("after:0:0")
        assert manager.done_record("q", "lost:0:0") is None
    finally:
        sender.close()
        manager.close()
