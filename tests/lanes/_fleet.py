"""A worker process of the lane concurrency test (importable, for the spawn start method).

Each worker builds its own store, then loops: claim due tasks for the lane, "run" each for a few
milliseconds, complete it. It records what it did with ``time.time()`` stamps taken right after
the claim returned and right before ``complete``, so each recorded interval lies inside the time
the lane counted the task as active. Some workers abandon their first tasks (no complete), as a
crashed worker would; those leases must expire and another worker must take the tasks over.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from celery_claims.lanes import LeaseLost, TaskLaneConfig, claim_due_for_lane

#: The lane under test: at most 3 tasks processing at once, fleet-wide.
FLEET_LANE = TaskLaneConfig(lane="fleet", kinds=("job",), limit=3)
#: Leases last 1 s, so abandoned tasks come back quickly.
STALE_SECS = 1
#: Each task "runs" for a random time in this range, in seconds.
TASK_SECS = (0.001, 0.006)
#: A worker gives up after this long even if tasks remain (the test then fails on its checks).
DEADLINE_SECS = 40.0
#: Pause between passes that claimed nothing.
IDLE_SECS = 0.002


@dataclass
class WorkerSpec:
    """What one worker process needs to know."""

    backend: str  # "redis" or "postgres"
    url: str
    prefix: str  # Redis key prefix or SQL table prefix
    schema: str | None
    worker: int
    abandon: int  # how many of its first claimed tasks the worker abandons
    seed: int


@dataclass
class WorkerLog:
    """What one worker did: ``(task_id, token, start, finish)`` per completed task, and more."""

    worker: int
    completed: list[tuple[int, int, float, float]] = field(default_factory=list)
    # (task_id, token, start, lease_expires_at) of tasks claimed and then abandoned
    abandoned: list[tuple[int, int, float, float]] = field(default_factory=list)
    lost: list[tuple[int, int]] = field(default_factory=list)
    passes: int = 0


def build_store(spec: WorkerSpec) -> Any:
    """The store the spec names, for the fleet lane."""
    if spec.backend == "redis":
        from celery_claims.lanes.redis import RedisTaskClaimStore

        return RedisTaskClaimStore(url=spec.url, lanes=[FLEET_LANE], prefix=spec.prefix)
    from celery_claims.lanes.sql import SqlTaskClaimStore

    return SqlTaskClaimStore(
        url=spec.url, lanes=[FLEET_LANE], table_prefix=spec.prefix, schema=spec.schema
    )


def run_worker(spec: WorkerSpec) -> WorkerLog:
    """Dispatch the fleet lane until no task is left unfinished (or the deadline passes)."""
    rng = random.Random(spec.seed)
    store = build_store(spec)
    log = WorkerLog(spec.worker)
    last_claimed_at: list[datetime] = []

    def clock() -> datetime:
        now = datetime.now(timezone.utc)
        last_claimed_at.append(now)
        return now

    deadline = time.time() + DEADLINE_SECS
    try:
        while time.time() < deadline:
            log.passes += 1
            last_claimed_at.clear()
            claimed = claim_due_for_lane(
                store, FLEET_LANE, STALE_SECS, lambda kind: "fleet", clock=clock
            )
            if not claimed:
                if store.count_unfinished(FLEET_LANE.kinds) == 0:
                    break
                time.sleep(IDLE_SECS)
                continue
            # The second clock read is claimed_at; the lease runs STALE_SECS from it.
            lease_ends = last_claimed_at[-1] + timedelta(seconds=STALE_SECS)
            for _task, lease in claimed:
                # Taken after the claim returned: inside the window the lane counts the task.
                start = time.time()
                if len(log.abandoned) < spec.abandon:
                    log.abandoned.append(
                        (lease.task_id, lease.processing_token, start, lease_ends.timestamp())
                    )
                    continue
                time.sleep(rng.uniform(*TASK_SECS))
                finish = time.time()
                try:
                    store.complete(lease.task_id, lease.processing_token)
                except LeaseLost:
                    log.lost.append((lease.task_id, lease.processing_token))
                    continue
                # The lane promises nothing past the lease (a real worker would heartbeat); only
                # a stalled process gets there, so the interval is clipped to the lease.
                finish = min(finish, lease_ends.timestamp())
                start = min(start, finish)
                log.completed.append((lease.task_id, lease.processing_token, start, finish))
    finally:
        store.close()
    return log
