"""Real ``celery worker -P gevent`` / ``-P eventlet`` subprocesses: a crashed worker's task is
taken over there too.

Without an event loop (the green pools run Celery's blocking ``synloop``) kombu's Redis
transport never runs its restore sweep: the sweep is attempted only after a poll that saw
nothing, and the consumer's ``BRPOP`` answers every second. Measured on kombu 5.7 before the
fix: the dead worker's message stayed in ``unacked`` for good (40 s with a 3 s visibility
timeout), on plain Celery as with claims.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from tests.servers import RedisServer
from tests.worker.helpers import LEASE_MS, unique, wait_done, wait_for
from tests.worker.processes import Fleet, executions

pytestmark = pytest.mark.slow

#: kombu restores an unacked Redis message after this many seconds (FAST_REDELIVERY).
VISIBILITY_TIMEOUT_S = 3


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_killing_the_holding_green_worker_hands_the_task_to_the_other_worker(
    pool: str, fleet: Fleet, private_redis: RedisServer
) -> None:
    # a test extra (setup.cfg): missing fails, never skips (not imported here: eventlet warns)
    assert importlib.util.find_spec(pool) is not None, f"{pool} is not installed"
    # Given two green workers of one queue and a task running on one of them
    url, queue = private_redis.url, unique(f"q-{pool}")
    for name in ("a", "b"):
        fleet.worker(name, broker=url, backend=url, queue=queue, pool=pool, concurrency=4)
    workers = {p.name: p.wait_ready() for p in fleet.procs}
    client = fleet.client(url, url, queue)
    result = client.send_task("fleet.sleep", (4,), task_id=f"green-{pool}")
    first = wait_for(
        lambda: [e for e in executions(url, queue) if e["event"] == "start"],
        timeout=20,
        what="the first run",
    )[0]
    holder = str(first["worker"]).split("@")[0]

    # When the holding worker is killed mid-task
    workers[holder].kill_group()
    killed_at = time.monotonic()

    # Then the survivor gets the message back and takes the expired claim over
    margin_s = 12
    assert result.get(timeout=LEASE_MS / 1000 + VISIBILITY_TIMEOUT_S + 4 + margin_s) == 4, (
        fleet.logs()
    )
    runs = [e for e in executions(url, queue) if e["event"] == "start"]
    survivor = ({"a", "b"} - {holder}).pop()
    assert [str(r["worker"]).split("@")[0] for r in runs] == [holder, survivor], (
        time.monotonic() - killed_at
    )
    claims = fleet.claims(url)
    wait_done(claims, queue, f"green-{pool}:0:0")
    assert claims.queue_stats()[queue].takeovers == 1
