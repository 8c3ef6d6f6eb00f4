"""A hung task past its time limit in a pool that does not stop it: its claim is not renewed
for ever, and another copy takes the task over (real ``celery worker`` subprocesses).

Celery enforces time limits in prefork only (and gevent's hard limit while the task yields);
in the threads, solo and eventlet pools a hung task runs on. Before the fix its claim was
renewed as long as it hung, so no other copy could ever run it.
"""

from __future__ import annotations

import pytest

from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_for
from tests.worker.processes import Fleet, Proc, events_of, executions

pytestmark = pytest.mark.slow

#: The pools whose worker never stops a task at its time limit.
POOLS = ("threads", "solo", "eventlet")


def test_a_task_hung_past_its_time_limit_is_taken_over_in_every_pool_that_does_not_stop_it(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given, for each pool that does not enforce time limits, a worker of its own queue running
    # a task that hangs for 60 s past its 2 s time limit
    url = private_redis.url
    queues = {pool: unique(f"q-{pool}") for pool in POOLS}
    hung: dict[str, Proc] = {}
    for pool, queue in queues.items():
        hung[pool] = fleet.worker(f"hung-{pool}", broker=url, backend=url, queue=queue, pool=pool)
    for proc in hung.values():
        proc.wait_ready()
    for pool, queue in queues.items():
        fleet.client(url, url, queue).send_task("fleet.hang_once", task_id=f"hang-{pool}")
    for pool, queue in queues.items():
        wait_for(
            lambda q=queue, p=pool: events_of(executions(url, q), "start", f"hang-{p}"),
            timeout=20,
            what=f"the hung run on {pool}",
        )

    # When a second worker joins each queue
    for pool, queue in queues.items():
        fleet.worker(f"next-{pool}", broker=url, backend=url, queue=queue, pool="threads")

    # Then in every pool the task runs again and ends, under a claim taken over from the
    # hung copy, while the hung copy still hangs
    claims = fleet.claims(url)
    for pool, queue in queues.items():
        ends = wait_for(
            lambda q=queue, p=pool: events_of(executions(url, q), "end", f"hang-{p}"),
            timeout=40,
            what=f"the second run on {pool}\n{fleet.logs()}",
        )
        starts = events_of(executions(url, queue), "start", f"hang-{pool}")
        assert len(starts) == 2, (pool, starts)
        assert len(ends) == 1, (pool, ends)
        record = wait_for(
            lambda q=queue, p=pool: claims.done_record(q, f"hang-{p}:0:0"), timeout=10
        )
        assert record.owner.split("/")[0] == ends[0]["worker"], (pool, record)
        assert claims.queue_stats()[queue].takeovers == 1, pool
        assert hung[pool].alive()
        # and the worker said why, and said at start that its pool does not stop hung tasks
        log = hung[pool].output()
        assert "has run past its time limit (2 s)" in log, (pool, log[-3000:])
        assert f"the {pool} pool does not enforce time limits" in log, (pool, log[-3000:])
