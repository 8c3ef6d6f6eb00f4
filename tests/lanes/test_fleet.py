"""Six processes dispatch one lane of limit 3 over 500 short tasks, against Redis and PostgreSQL.

An interval checker built from the recorded start/finish times proves that no more than 3 tasks
were ever processing at once, that every task completed exactly once, and that the tasks some
workers abandoned were taken over by others once their leases expired.
"""

from __future__ import annotations

import collections
import multiprocessing
import uuid
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timedelta, timezone

import pytest

from celery_claims.lanes import TaskStatus
from tests.lanes._fleet import FLEET_LANE, WorkerLog, WorkerSpec, build_store, run_worker
from tests.lanes.conftest import Postgres
from tests.lanes.intervals import max_overlap
from tests.servers import RedisServer

TASKS = 500
WORKERS = 6
#: Workers 0 and 1 each abandon their first two tasks, as a crashed worker would.
ABANDONING = {0: 2, 1: 2}


def test_interval_checker_counts_overlaps_and_lets_touching_intervals_pass() -> None:
    assert max_overlap([])[0] == 0
    assert max_overlap([(0, 1), (1, 2), (2, 3)])[0] == 1
    assert max_overlap([(0, 10), (1, 2), (1.5, 3), (1.8, 1.9)]) == (4, 1.8)
    with pytest.raises(ValueError, match="ends before"):
        max_overlap([(2, 1)])


def run_fleet(backend: str, url: str, prefix: str, schema: str | None) -> None:
    # Given 500 due tasks in a lane of limit 3
    seed_spec = WorkerSpec(backend, url, prefix, schema, -1, 0, 0)
    store = build_store(seed_spec)
    if backend == "postgres":
        store.create_tables()
    due = datetime.now(timezone.utc) - timedelta(seconds=1)
    for task_id in range(TASKS):
        store.enqueue(task_id, "job", next_run_at=due)

    # When 6 spawned processes dispatch the lane until every task is done
    specs = [
        WorkerSpec(backend, url, prefix, schema, worker, ABANDONING.get(worker, 0), seed=worker)
        for worker in range(WORKERS)
    ]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(WORKERS, mp_context=context) as pool:
        logs: list[WorkerLog] = list(pool.map(run_worker, specs))

    try:
        # Then at no instant were more than 3 tasks processing (abandoned ones until lease end)
        intervals = [(start, end) for log in logs for _, _, start, end in log.completed]
        intervals += [(start, end) for log in logs for _, _, start, end in log.abandoned]
        most, when = max_overlap(intervals)
        assert most <= FLEET_LANE.limit, f"{most} tasks processing at once at {when}"
        # And every task was completed exactly once, and is done in the store
        completions = collections.Counter(t for log in logs for t, _, _, _ in log.completed)
        assert sorted(completions) == list(range(TASKS))
        assert set(completions.values()) == {1}
        assert store.count_unfinished(FLEET_LANE.kinds) == 0
        final = {t: token for log in logs for t, token, _, _ in log.completed}
        for task_id in (0, 250, TASKS - 1):
            task = store.get_task(task_id)
            assert (task.status, task.processing_token) == (TaskStatus.DONE, final[task_id])
        # And the abandoned tasks were taken over by a later attempt with a larger token
        abandoned = [(t, token) for log in logs for t, token, _, _ in log.abandoned]
        assert len(abandoned) == sum(ABANDONING.values())
        for task_id, token in abandoned:
            assert final[task_id] > token
        # And the lane was shared: more than one worker completed tasks
        assert sum(1 for log in logs if log.completed) > 1
    finally:
        if backend == "postgres":
            store.drop_tables()
        store.close()


@pytest.mark.slow
def test_six_redis_workers_never_exceed_the_lane_limit(redis_server: RedisServer) -> None:
    run_fleet("redis", redis_server.url, f"fleet{uuid.uuid4().hex[:8]}", None)


@pytest.mark.slow
@pytest.mark.postgres
def test_six_postgres_workers_never_exceed_the_lane_limit(postgres: Postgres) -> None:
    run_fleet("postgres", postgres.url, f"fleet{uuid.uuid4().hex[:8]}_", postgres.schema)
