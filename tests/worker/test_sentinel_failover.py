"""A Sentinel failover in mid-run: every task still runs, once, and no completion record is lost.

A claim store on a Sentinel-managed master (one replica, three Sentinels) while
``SENTINEL FAILOVER`` moves the master to the replica. Replication is asynchronous and the old
master keeps accepting writes for about 11 s after the switch (until the Sentinels demote it),
then discards them: a worker must find the new master, claim again there what it holds, and
write again there the completion records the old master took, or a later copy of a finished
task runs again.

The short test (one worker, ten tasks) runs in the default suite; the ``soak`` one (two
workers, sixty tasks) measures what the switch costs and prints it.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from celery_claims import RedisClaimManager
from tests.servers import RedisSentinels, RedisServer
from tests.worker.helpers import unique
from tests.worker.processes import Fleet, executions

#: Tasks sent, one every ``GAP_S``, each running ``TASK_S``; the failover comes halfway.
TASKS = 60
GAP_S = 0.1
TASK_S = 1.5

#: Seconds a worker gets to write again on the new master what the old one took.
RESTORE_S = 5.0


@pytest.fixture
def sentinels() -> Iterator[RedisSentinels]:
    group = RedisSentinels()
    try:
        yield group.start()
    finally:
        group.cleanup()


def _start(fleet: Fleet, names: str, sentinels: RedisSentinels, broker: str, queue: str) -> None:
    env = {"CLAIMS_TEST_CONF": json.dumps({"claims_redis_options": sentinels.options})}
    for name in names:
        fleet.worker(
            name, broker=broker, backend=broker, queue=queue, concurrency=2, env=env,
            extra=("--claims-redis-url", sentinels.url),
        )  # fmt: skip
    for proc in fleet.procs:
        proc.wait_ready()


def _unrecorded(sentinels: RedisSentinels, queue: str, ids: list[str]) -> list[str]:
    """The tasks of ``ids`` with no completion record on the (new) master, waiting a little."""
    deadline = time.monotonic() + RESTORE_S
    with RedisClaimManager(url=sentinels.url, options=sentinels.options) as store:
        while True:
            missing = [i for i in ids if store.done_record(queue, f"{i}:0:0") is None]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)


@pytest.mark.slow
def test_completions_written_during_a_sentinel_failover_are_kept_on_the_new_master(
    fleet: Fleet, sentinels: RedisSentinels, private_redis: RedisServer
) -> None:
    # Given one prefork worker (-c 2) whose claim store is the Sentinel-managed master, and
    # ten 1 s tasks queued for it
    broker, queue = private_redis.url, unique("q")
    _start(fleet, "a", sentinels, broker, queue)
    client = fleet.client(broker, broker, queue)
    ids = [f"f{i}" for i in range(10)]
    results = [client.send_task("fleet.sleep", (1.0,), task_id=i) for i in ids]

    # When the master fails over once the first two have finished, while the rest run and
    # finish within the seconds the old master still takes writes
    results[0].get(timeout=30)
    results[1].get(timeout=30)
    sentinels.failover()

    # Then every task finishes once, and every completion record is on the new master
    for result in results:
        assert result.get(timeout=60) == 1.0, fleet.logs()
    unrecorded = _unrecorded(sentinels, queue, ids)
    runs = Counter(e["id"] for e in executions(broker, queue) if e["event"] == "start")
    assert unrecorded == [], fleet.logs()[-6000:]
    assert sorted(runs) == sorted(ids)
    assert max(runs.values()) == 1, runs


@pytest.mark.soak
def test_a_sentinel_failover_mid_run_keeps_every_task_exactly_once(
    fleet: Fleet, sentinels: RedisSentinels, private_redis: RedisServer
) -> None:
    # Given two prefork workers whose claim store is the Sentinel-managed master
    broker, queue = private_redis.url, unique("q")
    _start(fleet, "ab", sentinels, broker, queue)
    client = fleet.client(broker, broker, queue)

    # When tasks keep coming and the master fails over halfway through
    results, failover_s = [], 0.0
    for i in range(TASKS):
        results.append(client.send_task("fleet.sleep", (TASK_S,), task_id=f"t{i}"))
        if i == TASKS // 2:
            began = time.monotonic()
            sentinels.failover()
            failover_s = time.monotonic() - began
        time.sleep(GAP_S)

    # Then every task finishes (nothing lost), none ran twice, and every completion record
    # is on the new master (the records the old master took after the switch written again)
    for result in results:
        assert result.get(timeout=120) == TASK_S, fleet.logs()
    time.sleep(5)  # any late duplicate
    runs = Counter(e["id"] for e in executions(broker, queue) if e["event"] == "start")
    twice = sorted(task for task, count in runs.items() if count > 1)
    logs = fleet.logs()
    unrecorded = _unrecorded(sentinels, queue, [f"t{i}" for i in range(TASKS)])
    outputs = "".join(proc.output() for proc in fleet.procs)
    reclaimed = outputs.count("had lost it")
    restored = sum(
        int(n) for n in re.findall(r"(\d+) completion record\(s\) written again", outputs)
    )
    print(
        f"\nfailover reported by the Sentinels after {failover_s:.2f} s; "
        f"{len(runs)} tasks ran, {len(twice)} more than once {twice}; "
        f"{reclaimed} claim(s) found lost and claimed again; "
        f"{restored} completion record(s) written again on the new master; "
        f"{len(unrecorded)} completion record(s) missing on the new master {unrecorded}"
    )
    assert len(runs) == TASKS
    assert twice == [], logs[-6000:]
    assert unrecorded == [], logs[-6000:]
