"""Defect: a message popped by a worker's ``BRPOP`` is lost if the worker dies before kombu
records the delivery in ``unacked``.

kombu's Redis transport fetches with ``BRPOP`` and only afterwards, in a second round trip,
writes the delivery to ``unacked``/``unacked_index`` (``QoS.append``). A consumer killed
between the two (SIGKILL, OOM, a paused-then-killed process) takes the only copy with it:
none in the queue, none in ``unacked``, so visibility-timeout restore cannot bring it back.
Found by the chaos soak (seed 3: ``lost=1``). The fix: the producer journals each message it
publishes in the claim store, and workers re-publish journaled messages whose task is
neither done nor claimed once ``claims_journal_recover_after_ms`` has passed.

The test makes the window as wide as it likes: the worker is idle in ``BRPOP`` (a long
``brpop_timeout``), its main process is frozen with SIGSTOP, the task is published (Redis pops
it into the frozen worker's socket), and the worker is killed.
"""

from __future__ import annotations

import json
import signal

import pytest

from tests.servers import RedisServer
from tests.worker.helpers import FAST_JOURNAL, unique, wait_done, wait_for
from tests.worker.processes import Fleet, events_of, executions, unacked_task_ids

pytestmark = pytest.mark.slow

APP = "tests.worker.apps.defects_app"

JOURNAL = FAST_JOURNAL


def test_a_message_popped_by_a_worker_killed_before_it_recorded_the_delivery_runs_once(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a prefork worker idle in BRPOP (held open for 30 s) and a claims-aware producer
    broker, queue = private_redis.url, unique("q")
    conf = {**JOURNAL, "broker_transport_options": {"polling_interval": 30}}
    first = fleet.worker(
        "a",
        broker=broker,
        backend=broker,
        queue=queue,
        concurrency=1,
        app=APP,
        env={"CLAIMS_TEST_CONF": json.dumps(conf)},
    ).wait_ready()
    redis = fleet.redis(broker)
    wait_for(
        lambda: redis.info("clients")["blocked_clients"] >= 1,
        timeout=10,
        what="the worker blocked in BRPOP",
    )
    client = fleet.client(broker, broker, queue, plugin=True, conf=JOURNAL)

    # When its main process is frozen with the BRPOP outstanding on the server, the task is
    # published (Redis pops it into the frozen worker's socket buffer) and the worker dies
    first.kill_group(signal.SIGSTOP)
    assert redis.info("clients")["blocked_clients"] >= 1, "the BRPOP must still be outstanding"
    result = client.send_task("defects.sleep", (0.2,), task_id="fetch-window")
    wait_for(
        lambda: redis.info("clients")["blocked_clients"] == 0,
        timeout=5,
        what="Redis to hand the message to the frozen worker",
    )
    assert redis.llen(queue) == 0, "the message must have left the queue"
    assert "fetch-window" not in unacked_task_ids(redis), "kombu never recorded the delivery"
    first.kill_group(signal.SIGKILL)
    first.popen.wait(timeout=10)

    # Then another worker runs the task: it was not lost
    second = fleet.worker(
        "b",
        broker=broker,
        backend=broker,
        queue=queue,
        concurrency=1,
        app=APP,
        env={"CLAIMS_TEST_CONF": json.dumps(JOURNAL)},
    )
    wait_for(
        lambda: events_of(executions(broker, queue), "end", "fetch-window"),
        timeout=40,
        what="a run of the task (the message was lost with the killed worker)",
    )
    assert result.get(timeout=10) == 0.2
    wait_done(fleet.claims(broker), queue, "fetch-window:0:0")

    # And it ran exactly once, from the copy recovery re-published, whose journal entry goes
    assert len(events_of(executions(broker, queue), "start", "fetch-window")) == 1
    assert "re-published" in second.output()
    wait_for(
        lambda: not redis.keys("claims:{*}:j"),
        timeout=10,
        what="the journal entry of the completed task to be cleared",
    )
