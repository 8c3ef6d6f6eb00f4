"""Keyed claims on real prefork workers (2 workers x -c 2, Redis broker): one run per key at a
time fleet-wide, the skip and reschedule policies, takeover of a dead holder's key, a key kept
done for a while, and messages whose key cannot be made."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import pytest
import redis
from celery.exceptions import TaskRevokedError

from celery_claims.claims.journal import RedisJournal
from celery_claims.observe import History
from tests.lanes.intervals import max_overlap
from tests.servers import RedisServer
from tests.worker.helpers import wait_for
from tests.worker.processes import Fleet

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.keyed_app"


def start_fleet(fleet: Fleet, url: str, queue: str, workers: int = 2) -> None:
    for name in ("a", "b")[:workers]:
        fleet.worker(name, broker=url, backend=url, queue=queue, app=APP, concurrency=2)
    for proc in fleet.procs:
        proc.wait_ready()


def runs(url: str, queue: str) -> list[dict[str, Any]]:
    client = redis.Redis.from_url(url)
    try:
        return [json.loads(raw) for raw in client.lrange(f"runs:{queue}", 0, -1)]
    finally:
        client.close()


def intervals(log: list[dict[str, Any]]) -> dict[str, list[tuple[float, float, str]]]:
    """Each key's finished runs: (start, end, task id)."""
    starts = {(e["id"], e["at"]): e for e in log if e["event"] == "start"}
    by_id: dict[str, list[float]] = defaultdict(list)
    for e in log:
        if e["event"] == "start":
            by_id[e["id"]].append(e["at"])
    out: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for e in log:
        if e["event"] == "end":
            begun = max(at for at in by_id[e["id"]] if at <= e["at"])
            key = json.dumps(starts[(e["id"], begun)]["key"])
            out[key].append((begun, e["at"], e["id"]))
    return out


def started(url: str, queue: str, task_id: str) -> list[dict[str, Any]]:
    return [e for e in runs(url, queue) if e["id"] == task_id and e["event"] == "start"]


def skips(url: str, task_id: str, count: int = 1) -> list[Any]:
    """The journal's ``skipped`` events of ``task_id``, waiting for ``count`` of them."""

    def read() -> list[Any]:
        client = redis.Redis.from_url(url)
        try:
            return [e for e in History(client, "claims").read(task_id) if e.event == "skipped"]
        finally:
            client.close()

    wait_for(lambda: len(read()) >= count, timeout=10, what=f"{task_id}'s journal")
    return read()


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The standalone ``celery-claims`` command on the fleet's store."""
    return subprocess.run(
        [sys.executable, "-m", "celery_claims.cli", "--redis-url", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_fifty_tasks_for_five_customers_never_run_one_customer_twice_at_once(
    private_redis: RedisServer, fleet: Fleet
) -> None:
    # Given 2 prefork workers (-c 2) and a task keyed on customer_id (the wait policy)
    url, queue = private_redis.url, "keyed-sync"
    start_fleet(fleet, url, queue)
    client = fleet.client(url, url, queue)

    # When 50 tasks for 5 customers are sent at once, two by two (c0, c0, c1, c1, ...), so
    # that without keys the four pool processes would run two of one customer together
    results = [
        client.send_task(
            "keyed.sync",
            (f"c{(i // 2) % 5}",),
            {"seconds": 0.2 + 0.05 * (i % 3)},
            task_id=f"sync-{i}",
        )
        for i in range(50)
    ]
    done = [r.get(timeout=90) for r in results]

    # Then every task ran exactly once, never two runs of one customer at the same time,
    # while different customers ran in parallel
    assert sorted(done) == sorted(f"sync-{i}" for i in range(50))
    log = runs(url, queue)
    assert sorted(e["id"] for e in log if e["event"] == "start") == sorted(done), fleet.logs()
    by_key = intervals(log)
    assert len(by_key) == 5
    for key, spans in by_key.items():
        assert len(spans) == 10
        assert max_overlap((s, e) for s, e, _ in spans)[0] == 1, (key, spans)
    everything = [(s, e) for spans in by_key.values() for s, e, _ in spans]
    assert max_overlap(everything)[0] >= 2
    # the fencing number of a key grows with each run of it
    for spans in by_key.values():
        ids = [i for _, _, i in sorted(spans)]
        instances = [next(e["instance"] for e in log if e["id"] == i) for i in ids]
        assert instances == sorted(instances)
        assert len(set(instances)) == len(instances)


def test_skip_acks_a_second_customer_task_without_running_it_and_names_the_holder(
    private_redis: RedisServer, fleet: Fleet
) -> None:
    # Given a task with the skip policy running for customer c1
    url, queue = private_redis.url, "keyed-skip"
    start_fleet(fleet, url, queue)
    client = fleet.client(url, url, queue)
    holder = client.send_task("keyed.skip", ("c1",), {"seconds": 4}, task_id="skip-holder")
    wait_for(lambda: started(url, queue, "skip-holder"), timeout=20, what="the holder's start")
    # (the CLI names the key's holder while it runs)
    shown = cli(url, "key", "keyed.skip['c1']")
    assert shown.returncode == 0, shown.stderr
    assert "RUNNING" in shown.stdout
    assert "(task skip-holder)" in shown.stdout
    listed = cli(url, "list", queue)
    assert "keyed.skip['c1']" in listed.stdout
    assert "skip-holder" in listed.stdout

    # When two more tasks for c1, a duplicate of the holder's own message, and a task for c2
    # arrive meanwhile
    others = [client.send_task("keyed.skip", ("c1",), task_id=f"skip-{i}") for i in range(2)]
    client.send_task("keyed.skip", ("c1",), {"seconds": 4}, task_id="skip-holder")
    free = client.send_task("keyed.skip", ("c2",), task_id="skip-c2")

    # Then the c1 ones are skipped: not run, their result REVOKED, the journal naming the holder;
    # c2 runs, and the holder finishes
    for result in others:
        with pytest.raises(TaskRevokedError):
            result.get(timeout=20)
        events = skips(url, result.id)
        assert [(e.reason, e.other) for e in events] == [("key_held", "skip-holder")]
    assert free.get(timeout=20) == "skip-c2"
    assert holder.get(timeout=20) == "skip-holder"
    assert not started(url, queue, "skip-0")
    assert not started(url, queue, "skip-1")
    # the holder's duplicate is not another task on the key: held, then skipped as done,
    # running neither twice nor overwriting the holder's result
    duplicate = skips(url, "skip-holder")
    assert [(e.reason, e.other) for e in duplicate] == [("done", duplicate[0].other)]
    assert len(started(url, queue, "skip-holder")) == 1
    assert holder.state == "SUCCESS"
    # and the key is free again, nothing is left behind in the broker
    assert cli(url, "key", "keyed.skip['c1']").returncode == 1
    plain = fleet.redis(url)
    assert plain.llen(queue) == 0
    wait_for(lambda: plain.hlen("unacked") == 0, timeout=10, what="no unacked delivery")


def test_reschedule_publishes_the_task_again_until_its_bound_then_waits_for_the_key(
    private_redis: RedisServer, fleet: Fleet
) -> None:
    # Given a task with the reschedule policy (1 s countdown, at most 2) holding customer c1
    url, queue = private_redis.url, "keyed-resched"
    start_fleet(fleet, url, queue)
    client = fleet.client(url, url, queue)
    holder = client.send_task("keyed.resched", ("c1",), {"seconds": 5}, task_id="r-holder")
    wait_for(lambda: started(url, queue, "r-holder"), timeout=20, what="the holder's start")

    # When a second task for c1 arrives
    second = client.send_task("keyed.resched", ("c1",), task_id="r-second")

    # Then it is rescheduled twice, then waits, and runs once, after the holder ended
    assert second.get(timeout=40) == "r-second"
    assert holder.get(timeout=5) == "r-holder"
    events = skips(url, "r-second", count=2)
    assert [(e.reason, e.other) for e in events] == [("key_rescheduled", "r-holder")] * 2
    by_key = intervals(runs(url, queue))
    spans = by_key[json.dumps("c1")]
    assert [i for _, _, i in sorted(spans)] == ["r-holder", "r-second"]
    assert max_overlap((s, e) for s, e, _ in spans)[0] == 1


def test_a_sigkilled_holders_key_is_taken_over_and_its_tasks_still_run_one_at_a_time(
    private_redis: RedisServer, fleet: Fleet
) -> None:
    # Given a task holding customer c1 on one worker, and a second one for c1 waiting
    url, queue = private_redis.url, "keyed-kill"
    start_fleet(fleet, url, queue)
    workers = {p.name: p for p in fleet.procs}
    client = fleet.client(url, url, queue)
    first = client.send_task("keyed.sync", ("c1",), {"seconds": 5}, task_id="k-first")
    begun = wait_for(lambda: started(url, queue, "k-first"), timeout=20, what="the first run")
    second = client.send_task("keyed.sync", ("c1",), {"seconds": 0.5}, task_id="k-second")

    time.sleep(1)  # the second message reaches a worker and waits for the key

    # When the holder's whole worker is SIGKILLed mid-task
    workers[str(begun[0]["worker"]).split("@")[0]].kill_group()
    killed_at = time.time()

    # Then the key is taken over once its lease runs out: both tasks finish, one at a time,
    # and the second started only after the holder died (it never ran beside it)
    assert second.get(timeout=40) == "k-second"
    assert first.get(timeout=40) == "k-first"
    log = runs(url, queue)
    assert all(e["at"] > killed_at for e in started(url, queue, "k-second")), log
    spans = intervals(log)[json.dumps("c1")]
    assert max_overlap((s, e) for s, e, _ in spans)[0] == 1
    assert sorted(i for _, _, i in spans) == ["k-first", "k-second"]
    claims = fleet.claims(url)
    assert claims.queue_stats()[queue].takeovers >= 1


def test_a_key_done_within_claims_key_done_ttl_skips_another_task_id(
    private_redis: RedisServer, fleet: Fleet
) -> None:
    # Given a payment task (claims_key_done_ttl=60) that completed for payment p1
    url, queue = private_redis.url, "keyed-pay"
    start_fleet(fleet, url, queue, workers=1)
    client = fleet.client(url, url, queue)
    assert client.send_task("keyed.pay", ("p1",), task_id="pay-1").get(timeout=20) == "pay-1"

    # When the same payment is sent again under another task id, and another payment too
    again = client.send_task("keyed.pay", ("p1",), task_id="pay-2")
    other = client.send_task("keyed.pay", ("p2",), task_id="pay-3")

    # Then the second p1 is skipped as done by pay-1, never run; p2 runs
    with pytest.raises(TaskRevokedError):
        again.get(timeout=20)
    assert [(e.reason, e.other) for e in skips(url, "pay-2")] == [("key_done", "pay-1")]
    assert other.get(timeout=20) == "pay-3"
    assert not started(url, queue, "pay-2")


def test_a_message_whose_key_cannot_be_made_is_recorded_failed_and_acked(
    private_redis: RedisServer, fleet: Fleet
) -> None:
    # Given a worker with a task keyed on (tenant, kind)
    url, queue = private_redis.url, "keyed-bad"
    start_fleet(fleet, url, queue, workers=1)
    # a producer that journals what it publishes (a refused message must not stay journaled:
    # journal recovery would publish it again and again)
    client = fleet.client(url, url, queue, plugin=True)

    # When messages arrive without the tenant, with a dict tenant, and with a huge one
    missing = client.send_task("keyed.export", (), {"kind": "csv"}, task_id="bad-missing")
    unhashable = client.send_task("keyed.export", ({"a": 1},), task_id="bad-dict")
    huge = client.send_task("keyed.export", ("x" * 500,), task_id="bad-huge")
    good = client.send_task("keyed.export", ("t1",), task_id="good")

    # Then each is recorded as failed with the reason, visibly, and acked; the good one runs
    for result, reason in (
        (missing, "do not bind"),
        (unhashable, "dict value cannot be a claim key"),
        (huge, "500 characters long"),
    ):
        with pytest.raises(Exception, match=reason) as raised:
            result.get(timeout=20)
        assert type(raised.value).__name__ == "KeyRefused"
        assert result.state == "FAILURE"
        assert [e.reason for e in skips(url, result.id)] == ["key_refused"]
    assert good.get(timeout=20) == "good"
    assert [e["id"] for e in runs(url, queue) if e["event"] == "start"] == ["good"]
    plain = fleet.redis(url)
    wait_for(lambda: plain.hlen("unacked") == 0, timeout=10, what="no unacked delivery")
    assert plain.llen(queue) == 0
    # and no journal entry of a refused message is left for recovery to publish again
    journal = RedisJournal(client=plain)
    refused = {f"{r.id}:0:0" for r in (missing, unhashable, huge)}
    wait_for(
        lambda: not refused & set(journal.entries(queue)),
        timeout=10,
        what="the refused messages' journal entries cleared",
    )
