"""Keyed lanes (issue 13, item 2): a per-key limit beside the lane's limit, fleet-wide, fair
between keys, leaving no key state behind; real prefork workers on a Redis broker
(the 30/3/1 scenario on RabbitMQ too)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
import redis

from tests.cli.conftest import json_of
from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_for
from tests.worker.lanefleet import events, lanes_worker, max_overlap
from tests.worker.processes import Fleet
from tests.worker.test_keyed import cli, skips

pytestmark = pytest.mark.slow

#: The scenario of the issue: limit 4, 1 per tenant; 3 tenants with 30, 3 and 1 tasks.
LIMIT, PER_KEY = 4, 1
TENANTS = {"tenant-big": 30, "tenant-mid": 3, "tenant-small": 1}
TASK_S = 0.3


def _runs(log: list[dict[str, Any]]) -> list[tuple[float, float, str, str]]:
    """(start, end, tenant, task id) of every run, in start order."""
    ends = {(e["id"], e["pid"]): e["at"] for e in log if e["event"] == "end"}
    runs = [
        (float(e["at"]), float(ends[(e["id"], e["pid"])]), str(e["tenant"]), str(e["id"]))
        for e in log
        if e["event"] == "start"
    ]
    return sorted(runs)


def _lane_state(url: str) -> dict[bytes, list[bytes]]:
    """Every key of the lane store with what it holds (names, members, values)."""
    with contextlib.closing(redis.Redis.from_url(url)) as client:
        found: dict[bytes, list[bytes]] = {}
        for key in client.scan_iter(match="claims:lane*"):
            kind = client.type(key)
            if kind == b"hash":
                found[key] = [*client.hkeys(key), *client.hvals(key)]
            elif kind == b"zset":
                found[key] = client.zrange(key, 0, -1)
            else:
                found[key] = [client.dump(key) or b""]
        return found


def test_a_keyed_lane_caps_each_tenant_and_the_lane_and_small_tenants_are_not_starved(
    request: pytest.FixtureRequest, broker: str, fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given lane "exports" (limit 4, 1 per tenant_id) and 2 workers x prefork -c 2, on a
    # Redis broker or RabbitMQ (claims, lanes and results in a private Redis)
    url, queue = private_redis.url, unique("exports")
    if hasattr(request.node, "rabbitmq_queues"):
        request.node.rabbitmq_queues.extend([queue, f"{queue}-other"])
    lanes = {
        "exports": {"queues": [queue], "limit": LIMIT, "key": "tenant_id", "limit_per_key": PER_KEY}
    }
    workers = [
        lanes_worker(
            fleet, name, broker=broker, backend=url, queue=queue, lanes=lanes, lane_recheck_ms=200
        )
        for name in ("a", "b")
    ]
    for proc in workers:
        proc.wait_ready()
    client = fleet.client(broker, url, queue)

    # When the big tenant's 30 tasks are sent first, then the others' 3 and 1
    results = [
        client.send_task("lanes.export", (tenant, TASK_S), task_id=f"export-{tenant[7:]}-{i}")
        for tenant, count in TENANTS.items()
        for i in range(count)
    ]

    # Then every task ran, once
    assert all(r.get(timeout=120) for r in results), fleet.logs()
    runs = _runs(events(url, queue))
    assert sorted(run[3] for run in runs) == sorted(r.id for r in results)

    # ... never two of one tenant at once, never more than 4 in all (from the recorded runs)
    for tenant in TENANTS:
        mine = [(start, end) for start, end, who, _ in runs if who == tenant]
        assert max_overlap(mine) <= PER_KEY, tenant
    assert max_overlap([(start, end) for start, end, _, _ in runs]) <= LIMIT
    # ... different tenants did run side by side
    assert max_overlap([(start, end) for start, end, _, _ in runs]) >= 2

    # ... the small tenants finished long before the big one: by the time the last of them
    # ended, at most a third of the big tenant's tasks had started (in a FIFO lane, they
    # would wait behind all 30)
    small_done = max(end for _, end, who, _ in runs if who != "tenant-big")
    big_started = sum(1 for start, _, who, _ in runs if who == "tenant-big" and start < small_done)
    assert big_started <= TENANTS["tenant-big"] // 3, runs

    # ... and no key's name is left in the lane store, once the slots are released (a task's
    # result is stored before its worker's release of its lane slot reaches the store)
    def named() -> list[tuple[bytes, list[bytes]]]:
        return [
            (key, values)
            for key, values in _lane_state(url).items()
            if any(b"tenant-" in part for part in [key, *values])
        ]

    assert _lane_state(url), "the lane store is empty: the test looked in the wrong place"
    wait_for(lambda: not named(), timeout=15, what="the lane slots' release")


def test_a_message_without_a_usable_lane_key_is_recorded_failed_and_acked_never_lost(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a keyed lane on tenant_id and one worker
    url, queue = private_redis.url, unique("exports")
    lanes = {"exports": {"queues": [queue], "limit": 2, "key": "tenant_id", "limit_per_key": 1}}
    lanes_worker(fleet, "a", broker=url, backend=url, queue=queue, lanes=lanes).wait_ready()
    client = fleet.client(url, url, queue)

    # When messages arrive without the tenant, with a dict tenant, and with a huge one
    missing = client.send_task("lanes.export", (), {"seconds": 0.1}, task_id="bad-missing")
    unhashable = client.send_task("lanes.export", ({"a": 1}, 0.1), task_id="bad-dict")
    huge = client.send_task("lanes.export", ("x" * 500, 0.1), task_id="bad-huge")
    good = client.send_task("lanes.export", ("t1", 0.1), task_id="good")

    # Then each is refused visibly: recorded as failed with the reason, journaled, acked
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
    # ... the good one runs, and nothing is left unacked or queued
    assert good.get(timeout=20)
    assert [e["id"] for e in events(url, queue) if e["event"] == "start"] == ["good"]
    plain = fleet.redis(url)
    wait_for(lambda: plain.hlen("unacked") == 0, timeout=10, what="no unacked delivery")
    assert plain.llen(queue) == 0


def _kill_a_tenants_holder(fleet: Fleet, url: str) -> tuple[str, str, float, list[Any]]:
    """A keyed lane (limit 2, 1 per tenant) on 2 workers x prefork -c 2; tenant t-kill's first
    task (8 s) running on one worker and its second (0.5 s) waiting for t-kill's slot; then
    the holder's whole worker (main process and pool) SIGKILLed mid-task.

    Returns:
        The queue, the surviving worker's name, when the kill was sent (epoch s), and the two
        tasks' results.
    """
    queue = unique("exports")
    lanes = {"exports": {"queues": [queue], "limit": 2, "key": "tenant_id", "limit_per_key": 1}}
    workers = {
        name: lanes_worker(
            fleet, name, broker=url, backend=url, queue=queue, lanes=lanes, lane_recheck_ms=200
        )
        for name in ("a", "b")
    }
    for proc in workers.values():
        proc.wait_ready()
    client = fleet.client(url, url, queue)
    first = client.send_task("lanes.export", ("t-kill", 8), task_id="kill-first")
    begun = wait_for(
        lambda: [e for e in events(url, queue) if e["event"] == "start"],
        timeout=20,
        what="the first run",
    )
    holder = str(begun[0]["worker"]).split("@")[0]
    second = client.send_task("lanes.export", ("t-kill", 0.5), task_id="kill-second")
    wait_for(
        lambda: any(
            e["event"] == "held" and e["reason"] == "lane" and e["id"] == "kill-second"
            for e in events(url, queue)
        ),
        timeout=20,
        what="the second task waiting for its tenant's slot",
    )
    workers[holder].kill_group()
    return queue, "b" if holder == "a" else "a", time.time(), [first, second]


def test_a_sigkilled_workers_keyed_lane_slot_is_taken_over_and_its_tenant_never_runs_twice(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a keyed lane (limit 2, 1 per tenant), tenant t-kill's first task running on one
    # worker and its second waiting for t-kill's slot
    # When the holder's worker is SIGKILLed mid-task
    url = private_redis.url
    queue, survivor, killed_at, results = _kill_a_tenants_holder(fleet, url)
    # (its slot still counts for t-kill: its lease has not run out yet)
    assert json_of(cli(url, "key", "exports['t-kill']", "--json"))["lanes"] == [
        {"lane": "exports", "running": 1}
    ]

    # Then, once the dead worker's leases expire, its lane slot and t-kill's slot are free:
    # the redelivered first task (taken over) and the second run on the other worker
    assert all(r.get(timeout=60) for r in results), fleet.logs()
    log = events(url, queue)
    after = [e for e in log if e["event"] == "start" and e["at"] > killed_at]
    assert sorted(e["id"] for e in after) == ["kill-first", "kill-second"], log
    assert all(str(e["worker"]).startswith(f"{survivor}@") for e in after), log
    assert fleet.claims(url).queue_stats()[queue].takeovers >= 1
    # ... nothing holds t-kill's key any more
    assert cli(url, "key", "exports['t-kill']").returncode == 1

    # ... and never two runs of t-kill at once, counting the killed run until the kill
    ends = {(e["id"], e["pid"]): e["at"] for e in log if e["event"] == "end"}
    tenant_runs = [
        (float(e["at"]), float(ends.get((e["id"], e["pid"]), killed_at)))
        for e in log
        if e["event"] == "start" and e["tenant"] == "t-kill"
    ]
    assert len(tenant_runs) == 3  # the killed run, its takeover, the second task
    assert max_overlap(tenant_runs) == 1, tenant_runs


def test_a_sigkilled_workers_keyed_lane_ticket_leaves_no_key_name_behind(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given t-kill's holder SIGKILLed as above, and both of t-kill's tasks finished elsewhere
    url = private_redis.url
    _, _, _, results = _kill_a_tenants_holder(fleet, url)
    assert all(r.get(timeout=60) for r in results), fleet.logs()

    # Then, once the dead worker's ticket has been idle for the grace (TICKET_GRACE_LEASES
    # lane leases, 15 s here), the surviving worker purges it: no key's name is left in the
    # lane store
    def key_names_left() -> list[tuple[bytes, list[bytes]]]:
        return [
            (key, values)
            for key, values in _lane_state(url).items()
            if any(b"t-kill" in part for part in [key, *values])
        ]

    wait_for(lambda: not key_names_left(), timeout=60, what="the dead worker's ticket purged")
