"""A worker killed inside the Redis broker's restore sweep does not stall every takeover.

kombu's restore sweep (``QoS.restore_visible``) runs under a cross-worker lock in the broker,
``unacked_mutex``, that expires after ``unacked_mutex_expire`` seconds, 300 by default. A
worker killed while it holds the lock (SIGKILL, OOM, a poison task killing its process
group) never releases it: for the next five minutes no worker restores any dead consumer's
message, so no crashed holder's task is taken over, however short the visibility timeout and
the lease. Seen in the chaos soak (seed 11, CI): a task stayed unacked for the whole
two-minute drain after the poison task had killed workers in mid-sweep. The worker now bounds
the lock by the visibility timeout, unless the user set ``unacked_mutex_expire``.
"""

from __future__ import annotations

import time

import pytest
import redis
from kombu import Connection
from kombu.transport.redis import Mutex

from celery_claims.worker.transport.sweep import restore_mutex_expire
from tests.servers import RedisServer
from tests.worker.helpers import FAST_REDELIVERY, LEASE_MS, unique, wait_done, wait_for
from tests.worker.processes import Fleet, executions

#: Tags with no message behind them, old enough to be restored: the sweep that meets them
#: spends seconds on them (a transaction each), holding the lock, as a large restore does.
FILLER_TAGS = 5_000


def _killed_while_sweeping(fleet: Fleet, url: str, queue: str) -> None:
    """Start a worker running a long task, then kill it while it holds the restore lock."""
    holder = fleet.worker("holder", broker=url, backend=url, queue=queue).wait_ready()
    client = fleet.client(url, url, queue)
    client.send_task("fleet.sleep", (6,), task_id="held-on")
    wait_for(
        lambda: [e for e in executions(url, queue) if e["event"] == "start"],
        timeout=20,
        what="the task's first run",
    )
    broker = fleet.redis(url)
    broker.zadd("unacked_index", {f"filler-{i}": 1 for i in range(FILLER_TAGS)})
    wait_for(lambda: broker.exists("unacked_mutex"), timeout=20, what="the sweep's lock")
    holder.kill_group()
    assert broker.exists("unacked_mutex"), "the holder was not killed inside its sweep"


@pytest.mark.slow
def test_a_holder_killed_inside_the_restore_sweep_is_taken_over_within_the_visibility_timeout(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a worker killed mid-task while it held the restore sweep's lock
    url, queue = private_redis.url, unique("q-mutex")
    _killed_while_sweeping(fleet, url, queue)
    killed_at = time.monotonic()

    # When another worker of the queue starts
    fleet.worker("survivor", broker=url, backend=url, queue=queue).wait_ready()

    # Then it takes the task over once the lease, the visibility timeout and the dead
    # holder's lock have run out (three times the visibility timeout, against kombu's 300 s
    # lock), plus the time to restore the filler and start the task
    visibility = FAST_REDELIVERY["visibility_timeout"]
    claims = fleet.claims(url)
    wait_done(claims, queue, "held-on:0:0", timeout=LEASE_MS / 1000 + 3 * visibility + 30 + 30)
    starts = [
        str(e["worker"]).split("@")[0] for e in executions(url, queue) if e["event"] == "start"
    ]
    assert starts == ["holder", "survivor"], (starts, time.monotonic() - killed_at)
    assert claims.queue_stats()[queue].takeovers == 1


@pytest.mark.parametrize(
    ("url", "options", "expected"),
    [
        ("redis://127.0.0.1:6379/0", {"visibility_timeout": 9}, 9),
        ("redis://127.0.0.1:6379/0", {}, 300),  # kombu's 3600 s timeout: kombu's own 300 s
        ("rediss://127.0.0.1:6380/0", {"visibility_timeout": 0.5}, 1),
        ("sentinel://127.0.0.1:26379", {"visibility_timeout": 20}, 20),
        ("redis://127.0.0.1:6379/0", {"visibility_timeout": 9, "unacked_mutex_expire": 60}, None),
        ("amqp://guest@127.0.0.1//", {"visibility_timeout": 9}, None),
    ],
    ids=["visibility", "kombu-default", "at-least-1s", "sentinel", "user-set", "not-redis"],
)
def test_the_restore_lock_is_bounded_by_the_visibility_timeout_where_the_user_left_it(
    url: str, options: dict[str, float], expected: float | None
) -> None:
    # Given a broker URL and its transport options
    # When the worker reads the lock's expiry it sets
    # Then it is the visibility timeout (at least 1 s, at most kombu's 300 s), or nothing to
    # set where the user chose one or the broker is not Redis
    assert restore_mutex_expire(url, options) == expected


def test_the_bounded_lock_is_what_kombu_takes(private_redis: RedisServer) -> None:
    # Given a Redis broker connection with the bounded expiry in its transport options
    options = {
        "visibility_timeout": 3,
        "unacked_mutex_expire": restore_mutex_expire(private_redis.url, {"visibility_timeout": 3}),
    }
    with Connection(private_redis.url, transport_options=options) as conn:
        channel = conn.default_channel
        # When kombu's sweep takes its lock
        client = redis.Redis.from_url(private_redis.url)
        try:
            with Mutex(client, channel.unacked_mutex_key, channel.unacked_mutex_expire):
                ttl_ms = client.pttl(channel.unacked_mutex_key)
        finally:
            client.close()

    # Then the lock expires within the visibility timeout
    assert 0 < ttl_ms <= 3000
