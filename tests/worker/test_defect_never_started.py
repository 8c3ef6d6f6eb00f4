"""Defect: a claim whose copy the pool never starts is held forever.

The gate claims a copy and hands it to a pool process that never picks it up (frozen): the
claim is renewed by the main process for as long as it lives, so no other worker can run the
task. With ``claims_start_timeout_ms`` the copy is given up, its message left for another
worker, and the frozen copy, if it ever wakes up, does not run.
"""

from __future__ import annotations

import time

import pytest

from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_done, wait_for
from tests.worker.processes import Fleet, events_of, executions, paused, pool_children

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.defects_app"


def test_a_claimed_copy_the_pool_never_starts_is_given_up_and_run_once_by_another_worker(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given worker A (prefork, one process, start timeout 4 s) whose only pool process is
    # frozen, and a task claimed by A and handed to that process
    broker, queue = private_redis.url, unique("q")
    a = fleet.worker(
        "a", broker=broker, backend=broker, queue=queue, concurrency=1, app=APP,
        extra=("--claims-start-timeout-ms", "4000"),
    ).wait_ready()  # fmt: skip
    [child] = pool_children(a)
    claims = fleet.claims(broker)
    client = fleet.client(broker, broker, queue)
    with paused(child):
        result = client.send_task("defects.sleep", (1,), task_id="never-started")
        owner = wait_for(
            lambda: claims.is_claimed(queue, "never-started:0:0"),
            timeout=20,
            what="A to claim the task",
        )[0]
        assert owner.startswith("a@")

        # When worker B starts
        fleet.worker(
            "b", broker=broker, backend=broker, queue=queue, concurrency=1, app=APP,
            extra=("--claims-start-timeout-ms", "4000"),
        ).wait_ready()  # fmt: skip

        # Then A gives the claim up and B runs the task to completion
        assert result.get(timeout=40) == 1, fleet.logs()
        ends = events_of(executions(broker, queue), "end", "never-started")
        assert [e["worker"].split("@")[0] for e in ends] == ["b"]
        wait_done(claims, queue, "never-started:0:0")

    # And when A's pool process wakes up, its copy does not run the task again
    time.sleep(5.0)
    log = executions(broker, queue)
    ends = events_of(log, "end", "never-started")
    assert [e["worker"].split("@")[0] for e in ends] == ["b"], ends
    assert len(events_of(log, "start", "never-started")) == 1, log
    assert a.alive()
