"""What waits on a key (issue 13, item 3): ``claims key K`` lists, besides K's holder, the
copies waiting for K, on real prefork workers with a Redis broker: a keyed task's copy held
(policy ``wait``) while another task holds its key, and a keyed lane's message waiting for its
key's slot."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_for
from tests.worker.lanefleet import events, lanes_worker
from tests.worker.processes import Fleet
from tests.worker.test_keyed import cli, runs, start_fleet, started

pytestmark = pytest.mark.slow


def key_json(url: str, key: str) -> dict[str, Any]:
    """``celery-claims key KEY --json`` on the fleet's store (exit 1, "free", gives {})."""
    shown = cli(url, "key", key, "--json")
    assert shown.returncode in (0, 1), shown.stderr
    data: dict[str, Any] = json.loads(shown.stdout)
    return data if shown.returncode == 0 else {}


def waiting_ids(data: dict[str, Any], waits_for: str) -> list[str]:
    return [w["task_id"] for w in data.get("waiting", ()) if w["waits_for"] == waits_for]


def test_claims_key_lists_a_keyed_copy_held_for_the_key_while_its_holder_runs(
    private_redis: RedisServer, fleet: Fleet
) -> None:
    # Given 2 prefork workers and a keyed task (wait policy) running for customer c1
    url, queue = private_redis.url, "keyed-waiting"
    key = "keyed.sync['c1']"
    start_fleet(fleet, url, queue)
    client = fleet.client(url, url, queue)
    holder = client.send_task("keyed.sync", ("c1",), {"seconds": 6}, task_id="w-holder")
    wait_for(lambda: started(url, queue, "w-holder"), timeout=20, what="the holder's start")

    # When another task for c1 arrives (and one for c2, which waits on nothing)
    second = client.send_task("keyed.sync", ("c1",), {"seconds": 0.2}, task_id="w-second")
    other = client.send_task("keyed.sync", ("c2",), {"seconds": 0.2}, task_id="w-other")

    # Then `claims key` shows the holder running and the second copy waiting for the key,
    # held on a worker, naming the holder
    data = wait_for(
        lambda: (d := key_json(url, key)) and waiting_ids(d, "key") and d,
        timeout=20,
        what="the second copy listed as waiting",
    )
    assert [(c["state"], c["task_id"]) for c in data["claims"]] == [("running", "w-holder")]
    (waiter,) = data["waiting"]
    assert (waiter["task_id"], waiter["claim_id"]) == ("w-second", f"{queue}/{key}")
    assert waiter["worker"].split("@")[0] in ("a", "b")
    assert "w-holder" in waiter["holder"]
    table = cli(url, "key", key)
    assert table.returncode == 0, table.stderr
    assert "waiting on it: 1" in table.stdout
    assert "task w-second: WAITING for the key, held unacked on" in table.stdout
    assert waiting_ids(key_json(url, "keyed.sync['c2']"), "key") == []

    # And once the holder is done the second runs, and nothing waits on the key any more:
    # the key is free and its index of waiters is gone
    assert holder.get(timeout=30) == "w-holder"
    assert second.get(timeout=30) == "w-second"
    assert other.get(timeout=30) == "w-other"
    log = runs(url, queue)
    holder_end = next(e["at"] for e in log if e["id"] == "w-holder" and e["event"] == "end")
    assert started(url, queue, "w-second")[0]["at"] >= holder_end
    assert cli(url, "key", key).returncode == 1
    plain = fleet.redis(url)
    wait_for(
        lambda: not list(plain.scan_iter(match="claims:journal:key:*")),
        timeout=10,
        what="no index of waiters left",
    )


def test_claims_key_lists_a_keyed_lane_message_waiting_for_its_keys_slot(
    private_redis: RedisServer, fleet: Fleet
) -> None:
    # Given a keyed lane (limit 2, 1 per tenant) on a prefork worker (-c 2), tenant t1's
    # first task running
    url, queue = private_redis.url, unique("exports")
    lanes = {"exports": {"queues": [queue], "limit": 2, "key": "tenant_id", "limit_per_key": 1}}
    lanes_worker(
        fleet, "a", broker=url, backend=url, queue=queue, lanes=lanes, lane_recheck_ms=200
    ).wait_ready()
    client = fleet.client(url, url, queue)
    first = client.send_task("lanes.export", ("t1", 6), task_id="lane-first")
    wait_for(
        lambda: [e for e in events(url, queue) if e["event"] == "start"],
        timeout=20,
        what="the first run",
    )

    # When a second task for t1 arrives: the lane has room, t1's slot is taken
    second = client.send_task("lanes.export", ("t1", 0.2), task_id="lane-second")

    # Then `claims key "exports['t1']"` shows t1 holding one slot of the lane and the second
    # message waiting for t1's slot (claimed, not running)
    data = wait_for(
        lambda: (d := key_json(url, "exports['t1']")) and waiting_ids(d, "lane") and d,
        timeout=20,
        what="the second message listed as waiting",
    )
    assert data["lanes"] == [{"lane": "exports", "running": 1}]
    assert waiting_ids(data, "lane") == ["lane-second"]
    table = cli(url, "key", "exports['t1']")
    assert "lane exports: 1 running with this key" in table.stdout
    assert "task lane-second: WAITING for its key's slot of the lane" in table.stdout

    # And once both ran, the key holds nothing and nothing waits on it
    assert first.get(timeout=30)
    assert second.get(timeout=30)
    wait_for(
        lambda: cli(url, "key", "exports['t1']").returncode == 1,
        timeout=10,
        what="the lane key free",
    )
