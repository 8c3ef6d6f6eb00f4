"""Real prefork ``celery worker`` subprocesses on a private Redis: redelivery and crashes."""

from __future__ import annotations

import contextlib
import time

import pytest

from tests.servers import RedisServer
from tests.worker.helpers import LEASE_MS, RENEW_INTERVAL_MS, unique, wait_done, wait_for
from tests.worker.processes import Fleet, executions, plain_restore_sweep

pytestmark = pytest.mark.slow

#: kombu restores an unacked Redis message after this many seconds (FAST_REDELIVERY).
VISIBILITY_TIMEOUT_S = 3


def starts(backend: str, queue: str, task_id: str) -> list[dict[str, object]]:
    return [e for e in executions(backend, queue) if e["id"] == task_id and e["event"] == "start"]


@pytest.mark.parametrize("plugin", [True, False], ids=["with-claims", "without-claims"])
def test_a_long_task_redelivered_by_redis_runs_exactly_once_with_claims(
    plugin: bool, fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given two prefork workers (-c 2, acks_late) and a task longer than the visibility timeout
    url, queue = private_redis.url, unique("q")
    for name in ("a", "b"):
        fleet.worker(name, broker=url, backend=url, queue=queue, plugin=plugin)
    for proc in fleet.procs:
        proc.wait_ready()
    client = fleet.client(url, url, queue)

    # When the 12 s task runs while Redis keeps finding its message unacked (the plain
    # fleet's restores at kombu 5.7's cadence on kombu 5.3 to 5.6 too)
    with contextlib.nullcontext() if plugin else plain_restore_sweep(url):
        result = client.send_task("fleet.sleep", (12,), task_id="long-1")
        assert result.get(timeout=60) == 12
        # the result is in as soon as the first execution ends; wait for any other copy too
        time.sleep(VISIBILITY_TIMEOUT_S + 2)

    # Then with claims it ran once; without, the redelivered copies ran again
    runs = starts(url, queue, "long-1")
    if plugin:
        assert len(runs) == 1, fleet.logs()
        redis_client = fleet.redis(private_redis.url)
        assert redis_client.llen(queue) == 0
        assert redis_client.hlen("unacked") == 0
    else:
        assert len(runs) >= 2, "Redis did not redeliver: the with-claims case proves nothing"


def test_killing_the_holding_worker_hands_the_task_to_the_other_worker(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given two prefork workers and a task running on one of them
    url, queue = private_redis.url, unique("q")
    for name in ("a", "b"):
        fleet.worker(name, broker=url, backend=url, queue=queue)
    workers = {p.name: p.wait_ready() for p in fleet.procs}
    client = fleet.client(url, url, queue)
    result = client.send_task("fleet.sleep", (4,), task_id="crash-1")
    first = wait_for(lambda: starts(url, queue, "crash-1"), timeout=20, what="the first run")[0]
    holder = str(first["worker"]).split("@")[0]

    # When the holding worker's whole process group is killed mid-task
    workers[holder].kill_group()
    killed_at = time.monotonic()

    # Then the other worker takes over and finishes it within lease + visibility + margin
    margin_s = 10
    assert result.get(timeout=LEASE_MS / 1000 + VISIBILITY_TIMEOUT_S + 4 + margin_s) == 4
    took = time.monotonic() - killed_at
    runs = starts(url, queue, "crash-1")
    assert [str(r["worker"]).split("@")[0] for r in runs] == [holder, ({"a", "b"} - {holder}).pop()]
    assert result.state == "SUCCESS", took
    claims = fleet.claims(url)
    wait_done(claims, queue, "crash-1:0:0")
    assert claims.queue_stats()[queue].takeovers == 1


def test_child_sigkill_hard_time_limit_and_revoke_release_the_claim_once_leaving_no_key(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given one prefork worker
    url, queue = private_redis.url, unique("q")
    worker = fleet.worker("a", broker=url, backend=url, queue=queue, concurrency=3).wait_ready()
    client = fleet.client(url, url, queue)
    claims = fleet.claims(url)

    # When one task's child is SIGKILLed, one exceeds its hard time limit, and one is revoked
    # with terminate=True while it runs
    killed = client.send_task("fleet.kill_child", task_id="kill-1")
    limited = client.send_task("fleet.hard_limit", task_id="limit-1")
    revoked = client.send_task("fleet.sleep", (30,), task_id="revoke-1")
    wait_for(lambda: starts(url, queue, "revoke-1"), timeout=20, what="the revoked task to run")
    client.control.revoke("revoke-1", terminate=True, signal="SIGKILL")

    # Then each ends failed or revoked
    for result, state in ((killed, "FAILURE"), (limited, "FAILURE"), (revoked, "REVOKED")):
        wait_for(lambda r=result, s=state: r.state == s, timeout=20, what=f"{result.id} {state}")

    # And each claim was released exactly once: no claim and no claim key is left behind
    stats = claims.queue_stats()[queue]
    assert stats.successes == 3
    wait_for(lambda: claims.queue_stats()[queue].acks == 3, timeout=5, what="three releases")
    assert claims.list_claims(queue) == []
    assert fleet.redis(private_redis.url).hlen(claims.keys(queue).claims) == 0
    for task_id in ("kill-1", "limit-1", "revoke-1"):
        assert claims.done_record(queue, f"{task_id}:0:0") is None
    log = worker.output()
    assert "completion handling failed" not in log
    assert "could not release" not in log
    assert worker.alive()


def test_remaining_lease_never_drops_below_lease_minus_two_renew_intervals_on_prefork(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a prefork worker running a 10 s task
    url, queue = private_redis.url, unique("q")
    fleet.worker("a", broker=url, backend=url, queue=queue).wait_ready()
    client = fleet.client(url, url, queue)
    claims = fleet.claims(url)
    result = client.send_task("fleet.sleep", (10,), task_id="renew-prefork")
    wait_for(lambda: claims.list_claims(queue), timeout=20, what="the claim")

    # When the lease is sampled from outside until the task ends
    remaining = []
    while not result.ready():
        seconds, micros = claims.client.time()
        now = int(seconds) * 1000 + int(micros) // 1000
        remaining += [t.expires_at - now for t in claims.list_claims(queue)]
        time.sleep(0.05)

    # Then it never fell below lease - 2 x renew interval
    assert result.get(timeout=5) == 10
    assert len(remaining) > 50
    assert min(remaining) >= LEASE_MS - 2 * RENEW_INTERVAL_MS, min(remaining)
