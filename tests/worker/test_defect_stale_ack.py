"""Defect: a stale copy's ack deletes the new owner's delivery on the Redis broker.

kombu restores a message under its delivery tag, so the stale copy and the new owner's copy
are one entry in ``unacked``: acking the stale one removes the new owner's record, and if the
new owner then dies nothing brings the task back.
"""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_done, wait_for
from tests.worker.processes import (
    Fleet,
    events_of,
    executions,
    paused,
    unacked_task_ids,
)

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.defects_app"


def test_a_stale_copy_ending_leaves_the_new_owners_delivery_so_the_task_survives_its_crash(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given two prefork workers (one process each) and a 14 s task started on one of them
    broker, queue = private_redis.url, unique("q")
    workers = {
        name: fleet.worker(
            name, broker=broker, backend=broker, queue=queue, concurrency=1, app=APP
        ).wait_ready()
        for name in "ab"
    }
    client = fleet.client(broker, broker, queue)
    result = client.send_task("defects.sleep", (14,), task_id="stale-ack")
    first = wait_for(
        lambda: events_of(executions(broker, queue), "start", "stale-ack"),
        timeout=20,
        what="the first start",
    )[0]
    holder_name = first["worker"].split("@")[0]
    holder = workers[holder_name]
    other = workers["b" if holder_name == "a" else "a"]

    # When the holder's main process is frozen past its lease until the other worker has
    # taken the task over, and then resumed, so that its copy is stale and ends
    with paused(holder.popen.pid):
        wait_for(
            lambda: len(events_of(executions(broker, queue), "start", "stale-ack")) > 1,
            timeout=30,
            what="the takeover by the other worker",
        )
    wait_for(
        lambda: (
            not psutil.pid_exists(first["pid"])
            or events_of(executions(broker, queue), "end", "stale-ack")
        ),
        timeout=20,
        what="the stale copy to end",
    )
    # the stale copy's end is handled on the holder's event loop a moment later
    time.sleep(2.0)

    # Then the new owner's delivery is still recorded in the broker's unacked hash
    assert "stale-ack" in unacked_task_ids(fleet.redis(broker)), (
        "the stale copy removed the new owner's record from unacked"
    )

    # And when the new owner crashes, a third worker runs the task to completion: not lost
    other.kill_group(signal.SIGKILL)
    killed_at = time.time()
    fleet.worker("c", broker=broker, backend=broker, queue=queue, concurrency=1, app=APP)
    wait_for(
        lambda: [
            end
            for start in events_of(executions(broker, queue), "start", "stale-ack")
            if start["at"] > killed_at
            for end in events_of(executions(broker, queue), "end", "stale-ack")
            if end["pid"] == start["pid"] and end["at"] > start["at"]
        ],
        timeout=45,
        what="a run of the task after the new owner crashed (the task was lost)",
    )
    assert result.get(timeout=10) == 14
    wait_done(fleet.claims(broker), queue, "stale-ack:0:0")
