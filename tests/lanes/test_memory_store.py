"""The memory store under threads: each operation is atomic, as a store's transaction is."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

from celery_claims.lanes import LeaseLost, MemoryTaskClaimStore, TaskLaneConfig, claim_due_for_lane
from tests.lanes.intervals import max_overlap

LANE = TaskLaneConfig(lane="mail", kinds=("send",), limit=2)


def test_threads_dispatching_one_memory_store_complete_each_task_once_within_the_limit() -> None:
    # Given 200 due tasks in a lane of limit 2
    store: MemoryTaskClaimStore[str, str] = MemoryTaskClaimStore(lanes=[LANE])
    due = datetime.now(timezone.utc) - timedelta(seconds=1)
    for task_id in range(200):
        store.enqueue(task_id, "send", next_run_at=due)
    intervals: list[tuple[float, float]] = []
    done: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline and store.count_unfinished(LANE.kinds):
                for _task, lease in claim_due_for_lane(store, LANE, 30, lambda kind: "mail"):
                    start = time.time()
                    time.sleep(0.0005)
                    finish = time.time()
                    store.complete(lease.task_id, lease.processing_token)
                    with lock:
                        intervals.append((start, finish))
                        done.append(lease.task_id)
        except (LeaseLost, AssertionError) as exc:  # reported below, not lost in the thread
            errors.append(exc)

    # When 8 threads dispatch the lane at once
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Then no error, never more than 2 at once, every task completed exactly once
    assert errors == []
    assert max_overlap(intervals)[0] <= LANE.limit
    assert sorted(done) == list(range(200))
