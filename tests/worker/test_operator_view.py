"""What the operator sees of a message waiting for its lane, and of a task that failed.

A message is claimed before it waits for a slot of its lane, so the claim store alone shows it
as running; the worker's journal tells the two apart. A failed attempt leaves no claim and no
completion record; the journal says what happened. Real ``celery worker`` subprocess (the
journal is bound to a worker by ``worker_ready``, which only the ``celery worker`` command
sends).
"""

from __future__ import annotations

import pytest

from tests.cli.conftest import json_of, run_cli
from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_for
from tests.worker.lanefleet import events, lanes_worker
from tests.worker.processes import Fleet

pytestmark = pytest.mark.slow


def test_list_and_inspect_tell_a_message_waiting_for_its_lane_from_the_running_one(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a worker whose queue is a lane of limit 1, running one task and holding another
    url, queue = private_redis.url, unique("q")
    lanes = {"one": {"queues": [queue], "limit": 1}}
    worker = lanes_worker(fleet, "w", broker=url, backend=url, queue=queue, lanes=lanes,
                          pool="threads", concurrency=2).wait_ready()  # fmt: skip
    client = fleet.client(url, url, queue)
    client.send_task("lanes.work", (6,), task_id="runs-1")
    wait_for(lambda: any(e.get("id") == "runs-1" for e in events(url, queue)), timeout=20)
    client.send_task("lanes.work", (0.1,), task_id="waits-1")
    cli = ("--redis-url", url, "--prefix", "claims")

    # When the operator lists the live claims and inspects the waiting task
    def listed() -> dict[str, dict[str, object]]:
        views = json_of(run_cli(*cli, "list", "--json"))["claims"]
        return {v["task_id"]: v for v in views}

    claims = wait_for(
        lambda: (found := listed()).get("waits-1", {}).get("state") == "waiting" and found,
        timeout=20,
        what=f"the waiting claim\n{worker.output()[-3000:]}",
    )
    text = run_cli(*cli, "list")
    inspected = run_cli(*cli, "inspect", "waits-1")

    # Then both hold a live claim, one running, the other waiting for lane "one"
    assert claims["runs-1"]["state"] == "running"
    assert (claims["waits-1"]["state"], claims["waits-1"]["lane"]) == ("waiting", "one")
    assert "waiting (lane one)" in text.stdout, text.stdout
    assert "2 live claim(s), 1 of them waiting for a lane slot or a rate" in text.stdout
    assert "WAITING for a slot of lane one (claimed, not running yet)" in inspected.stdout
    assert "RUNNING" not in inspected.stdout
    assert "waiting for a slot of lane one (full)" in inspected.stdout  # the journal's line

    # And once the first task ends, the second got its slot and shows as running (or done)
    def moved_on() -> bool:
        out = run_cli(*cli, "inspect", "waits-1").stdout
        return "WAITING" not in out and ("RUNNING" in out or "DONE" in out) and bool(out)

    wait_for(moved_on, timeout=30, what="the second task to get its slot")
    assert "got a slot of lane one on w@" in run_cli(*cli, "inspect", "waits-1").stdout


def test_inspect_of_a_task_that_failed_says_it_failed_and_its_claim_was_released(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a task that ran and failed on a worker
    url, queue = private_redis.url, unique("q")
    lanes_worker(fleet, "w", broker=url, backend=url, queue=queue, pool="threads").wait_ready()
    result = fleet.client(url, url, queue).send_task("lanes.fail", task_id="fails-1")
    with pytest.raises(ValueError, match="boom"):
        result.get(timeout=20)
    cli = ("--redis-url", url, "--prefix", "claims")

    # When the operator inspects it
    inspected = wait_for(
        lambda: (out := run_cli(*cli, "inspect", "fails-1")).returncode == 0 and out,
        timeout=10,
        what="the journal of the failed task",
    )
    data = json_of(run_cli(*cli, "inspect", "fails-1", "--json"))

    # Then it is known: failed with ValueError on that worker, claim released
    assert "unknown to the claim store" not in inspected.stdout + inspected.stderr
    assert "the last attempt ended without success on w@" in inspected.stdout
    assert "(failed (ValueError)); its claim was released" in inspected.stdout
    assert data["found"] is True
    assert [(e["event"], e["reason"]) for e in data["history"]] == [
        ("released", "failed (ValueError)")
    ]
