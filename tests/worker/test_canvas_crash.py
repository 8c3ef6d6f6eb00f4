"""A worker killed after a canvas part's body returned, before Celery reported the part.

Celery's trace does three things after a body returns that a canvas waits on: it sends a
chain's next step and a task's callbacks, stores the result (a group's), and reports a chord's
part (the chord's body is sent by the last part reported). A completion record written before
those (when the body returns) turned the redelivered copy away as done: a chord or a group
waited forever for its part, a chain stopped at the step; so did a store unreachable as the
body ended. Such a part is now recorded after Celery's trace (never settled by its pool
process with its delivery), and the steps it sends after its body are of its own run, so a
part run again after a crash sends copies that are turned away (docs/semantics.md, *Canvas
parts are recorded after Celery's trace*).

Real ``celery worker`` subprocesses (``apps/canvas_app.py``); worker A is SIGKILLed (its whole
process group) at the point the test names, worker B is started after it and finishes the
canvas.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from celery import chain, chord, group

from tests.servers import RedisServer, redis_server
from tests.worker.helpers import unique, wait_for
from tests.worker.processes import Fleet, Proc, paused

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.canvas_app"
TIMEOUT = 40


def _worker(fleet: Fleet, name: str, redis_url: str, queue: str, crash: str = "") -> Proc:
    return fleet.worker(
        name, broker=redis_url, backend=redis_url, queue=queue, concurrency=1, app=APP,
        env={"CLAIMS_TEST_CRASH": crash},
    ).wait_ready()  # fmt: skip


def _bodies(fleet: Fleet, redis_url: str, queue: str) -> Counter[str]:
    """How many times each task's body ran to its end, by task name."""
    entries = [json.loads(e) for e in fleet.redis(redis_url).lrange(f"executions:{queue}", 0, -1)]
    return Counter(entry["name"] for entry in entries if entry["event"] == "end")


def _killed(fleet: Fleet, a: Proc, redis_url: str, queue: str) -> None:
    wait_for(lambda: not a.alive(), timeout=TIMEOUT, what="worker A to be killed")
    assert fleet.redis(redis_url).get(f"crashed:{queue}") is not None, fleet.logs()


def test_a_chord_part_whose_worker_dies_before_the_part_is_reported_runs_again_and_the_body_runs(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a chord of two parts, and worker A killed right after a part's body returned,
    # before Celery stored its result and reported the part to the chord
    url, queue = private_redis.url, unique("q")
    a = _worker(fleet, "a", url, queue, crash="done:canvas.part")
    client = fleet.client(url, url, queue)
    part, total = client.signature("canvas.part"), client.signature("canvas.total")
    result = chord(group(part.clone((1,)), part.clone((2,))), total).apply_async()
    _killed(fleet, a, url, queue)

    # When worker B starts
    _worker(fleet, "b", url, queue)

    # Then the killed part runs again, is reported, and the chord's body runs once
    assert result.get(timeout=TIMEOUT) == 3, fleet.logs()
    bodies = _bodies(fleet, url, queue)
    assert bodies["canvas.total"] == 1, bodies
    assert bodies["canvas.part"] == 3, (bodies, fleet.logs())  # the killed part twice


def test_a_group_member_whose_worker_dies_before_its_result_is_stored_runs_again(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a group of two, and worker A killed right after a member's body returned, before
    # Celery stored its result
    url, queue = private_redis.url, unique("q")
    a = _worker(fleet, "a", url, queue, crash="done:canvas.part")
    client = fleet.client(url, url, queue)
    part = client.signature("canvas.part")
    result = group(part.clone((1,)), part.clone((2,))).apply_async()
    _killed(fleet, a, url, queue)

    # When worker B starts
    _worker(fleet, "b", url, queue)

    # Then the killed member runs again and the group's result is whole
    assert result.get(timeout=TIMEOUT) == [1, 2], fleet.logs()
    assert _bodies(fleet, url, queue)["canvas.part"] == 3


def test_a_chain_step_whose_worker_dies_before_the_next_step_is_sent_runs_again_and_the_chain_ends(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a chain of three steps, and worker A killed when the first step, its body
    # returned, is about to send the second
    url, queue = private_redis.url, unique("q")
    a = _worker(fleet, "a", url, queue, crash="publish:canvas.step")
    client = fleet.client(url, url, queue)
    step = client.signature("canvas.step")
    result = chain(step.clone((1,)), step.clone(), step.clone()).apply_async()
    _killed(fleet, a, url, queue)

    # When worker B starts
    _worker(fleet, "b", url, queue)

    # Then the first step runs again and sends the second: the chain ends
    assert result.get(timeout=TIMEOUT) == 4, fleet.logs()
    assert _bodies(fleet, url, queue)["canvas.step"] == 4  # the first step twice


@pytest.mark.parametrize("producer", ["celery", "claims"])
def test_a_chain_step_run_again_after_sending_its_next_step_sends_a_copy_that_is_turned_away(
    fleet: Fleet, private_redis: RedisServer, producer: str
) -> None:
    # Given a chain of three steps (published by plain Celery: of no run; or with
    # install(app): of a run), and worker A killed after the first step's body returned and
    # its next step was sent, before the first step's completion was recorded
    url, queue = private_redis.url, unique("q")
    a = _worker(fleet, "a", url, queue, crash="success:canvas.step")
    client = fleet.client(url, url, queue, plugin=producer == "claims")
    step = client.signature("canvas.step")
    result = chain(step.clone((1,)), step.clone(), step.clone()).apply_async()
    _killed(fleet, a, url, queue)

    # When worker B starts: it runs the second step (sent once), and the first again, which
    # sends the second step once more
    _worker(fleet, "b", url, queue)

    # Then the chain ends, and the second and third steps ran once each: the second step's
    # new copy is of the first step's run, not a new one
    assert result.get(timeout=TIMEOUT) == 4, fleet.logs()
    wait_for(lambda: _bodies(fleet, url, queue)["canvas.step"] >= 4, timeout=TIMEOUT)
    ends = [json.loads(e) for e in fleet.redis(url).lrange(f"executions:{queue}", 0, -1)]
    by_id = Counter(e["id"] for e in ends)
    assert sorted(by_id.values()) == [1, 1, 2], by_id


def test_a_chain_step_whose_claim_cannot_be_verified_as_its_body_ends_runs_again_and_the_chain_ends(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a chain of a 4 s step and a quick one, on a worker whose claim store is apart
    url, queue = private_redis.url, unique("q")
    with redis_server() as store:
        assert store.proc is not None
        fleet.worker(
            "a", broker=url, backend=url, queue=queue, concurrency=1, app=APP,
            extra=("--claims-redis-url", store.url, "--claims-start-timeout-ms", "3000"),
        ).wait_ready()  # fmt: skip
        client = fleet.client(url, url, queue)
        slow, step = client.signature("canvas.slow_step"), client.signature("canvas.step")
        result = chain(slow.clone((1, 4.0)), step.clone()).apply_async()
        log = fleet.redis(url)
        wait_for(lambda: log.llen(f"executions:{queue}"), timeout=TIMEOUT, what="the start")

        # When the claim store stops answering while the first step runs, until its body
        # ended and its claim could not be verified (its lease may have run out)
        with paused(store.proc.pid):
            wait_for(
                lambda: _bodies(fleet, url, queue)["canvas.slow_step"],
                timeout=TIMEOUT,
                what="the first step's body to end",
            )
            time.sleep(5.0)
            # Then nothing was sent for it: the chain's next step waits
            assert _bodies(fleet, url, queue)["canvas.step"] == 0

        # And once the store is back, the first step runs again and the chain ends
        assert result.get(timeout=TIMEOUT) == 3, fleet.logs()
        bodies = _bodies(fleet, url, queue)
        assert bodies == Counter({"canvas.slow_step": 2, "canvas.step": 1}), bodies
        assert "cannot be verified at unreported" in fleet.logs()


def test_group_members_that_store_no_result_leave_no_delivery_behind(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a prefork worker with the claim store on its Redis broker, and a group of tasks
    # that store no result (acks_late): canvas parts, recorded after Celery's trace, so no
    # pool process settles their delivery itself
    url, queue = private_redis.url, unique("q")
    defects = "tests.worker.apps.defects_app"
    fleet.worker(
        "a", broker=url, backend=url, queue=queue, concurrency=2, app=defects
    ).wait_ready()  # fmt: skip
    client = fleet.client(url, url, queue)
    quiet = client.signature("defects.quiet")
    group(quiet.clone((i,)) for i in range(5)).apply_async()
    store = fleet.claims(url)
    wait_for(lambda: store.stats().acks == 5, timeout=TIMEOUT, what="the group's records")

    # When the broker's visibility timeout (3 s) has passed
    time.sleep(6.0)

    # Then every delivery was removed with its ack: none came back to be claimed again
    assert fleet.redis(url).hlen("unacked") == 0
    assert store.stats().attempts == 5, store.stats()
