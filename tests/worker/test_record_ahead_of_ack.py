"""A body that returned is not run again when its worker's main process stops before the ack.

With the claim store on the Redis broker, the worker's ack writes the completion record in the
same script that removes the delivery (``ack_done.lua``). The ack comes from the main process,
after the pool process has handed it the result; a main process paused past the lease (a GC
pause, a frozen VM) at that moment used to let the message be restored and another worker run
the finished task again. The pool process now sends the record before the result leaves it.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_done, wait_for
from tests.worker.processes import Fleet, events_of, executions, unacked_task_ids

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.defects_app"


def test_a_finished_task_whose_main_process_stops_before_the_ack_is_not_run_again(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given two prefork workers whose claim store is their Redis broker
    broker, queue = private_redis.url, unique("q")
    workers = {
        name: fleet.worker(
            name, broker=broker, backend=broker, queue=queue, concurrency=1, app=APP
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
        claims = fleet.claims(broker)
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
