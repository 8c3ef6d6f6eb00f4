"""What only the SQL store promises: the lane lock row, SQLite's serialization, driver errors."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa

from celery_claims.lanes import (
    ClaimedTask,
    IoError,
    TaskClaimCandidate,
    TaskLaneConfig,
    claim_due_for_lane,
)
from celery_claims.lanes.sql import SqlTaskClaimStore
from tests.lanes.conftest import LANES, MAIL, T0, Postgres, lane_of
from tests.lanes.intervals import max_overlap
from tests.servers import free_port

LEASE = T0 + timedelta(seconds=30)
TASKS = 60
THREADS = 4


@pytest.mark.postgres
def test_postgres_claim_waits_for_the_lane_lock_row(postgres: Postgres) -> None:
    # Given a store, a due task, and another transaction holding the lane's lock row
    store = SqlTaskClaimStore(
        engine=postgres.engine, lanes=LANES, table_prefix=f"w{uuid.uuid4().hex[:8]}_",
        schema=postgres.schema,
    )  # fmt: skip
    store.create_tables()
    try:
        store.enqueue(1, "send_email", next_run_at=T0)
        holder = postgres.engine.connect()
        transaction = holder.begin()
        holder.execute(
            sa.select(store.locks).where(store.locks.c.lock_key == "mail").with_for_update()
        )
        result: list[ClaimedTask] = []

        def claim() -> None:
            result.extend(
                store.claim_candidates_for_lane(
                    MAIL, [TaskClaimCandidate(0, 1, 0, 1)], T0, T0, LEASE
                )
            )

        # When a claim pass starts
        worker = threading.Thread(target=claim)
        worker.start()

        # Then PostgreSQL shows it waiting on a lock, and it claims only after the holder ends
        deadline = time.monotonic() + 30
        while not _someone_waits_on_a_lock(postgres.engine):
            assert time.monotonic() < deadline, "the claim never waited on the lane lock"
            time.sleep(0.01)
        assert worker.is_alive()
        assert result == []
        transaction.rollback()
        holder.close()
        worker.join(timeout=30)
        assert [c.task_id for c in result] == [1]
    finally:
        store.drop_tables()


def _someone_waits_on_a_lock(engine: sa.Engine) -> bool:
    with engine.connect() as conn:
        waiting = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        ).scalar_one()
    return int(waiting) > 0


def test_missing_lock_row_is_created_by_the_first_claim(tmp_path: Path) -> None:
    # Given a store whose lock row was deleted
    store = SqlTaskClaimStore(url=f"sqlite:///{tmp_path / 'lanes.db'}", lanes=LANES)
    store.create_tables()
    with store.engine.begin() as conn:
        conn.execute(sa.delete(store.locks))
    store.enqueue(1, "send_email", next_run_at=T0)

    # When a claim pass runs
    claimed = store.claim_candidates_for_lane(MAIL, [TaskClaimCandidate(0, 1, 0, 1)], T0, T0, LEASE)

    # Then it claims and the lock row is back
    assert [c.task_id for c in claimed] == [1]
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(store.locks.c.lock_key)).scalars().all() == ["mail"]
    store.close()


def test_create_tables_is_idempotent(tmp_path: Path) -> None:
    store = SqlTaskClaimStore(url=f"sqlite:///{tmp_path / 'lanes.db'}", lanes=LANES)
    store.create_tables()
    store.enqueue(1, "render", next_run_at=T0)
    store.create_tables()
    assert store.get_task(1) is not None
    store.close()


def test_sqlite_threads_sharing_a_file_never_exceed_the_lane_limit(tmp_path: Path) -> None:
    # Given 60 due tasks in a lane of limit 2, in one SQLite file
    lane = TaskLaneConfig(lane="mail", kinds=MAIL.kinds, limit=2)
    url = f"sqlite:///{tmp_path / 'lanes.db'}"
    setup = SqlTaskClaimStore(url=url, lanes=[lane, LANES[1]])
    setup.create_tables()
    due = datetime.now(timezone.utc) - timedelta(seconds=1)
    for task_id in range(TASKS):
        setup.enqueue(task_id, "send_sms", next_run_at=due)
    intervals: list[tuple[float, float]] = []
    done: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        # Each thread has its own engine: its own connections, as separate processes would.
        store = SqlTaskClaimStore(url=url, lanes=[lane, LANES[1]])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and store.count_unfinished(lane.kinds):
            for _task, lease in claim_due_for_lane(store, lane, 30, lane_of):
                start = time.time()
                time.sleep(0.001)
                finish = time.time()
                store.complete(lease.task_id, lease.processing_token)
                with lock:
                    intervals.append((start, finish))
                    done.append(lease.task_id)
        store.close()

    # When 4 threads dispatch the lane
    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # Then never more than 2 ran at once, and each task completed once
    assert max_overlap(intervals)[0] <= 2
    assert sorted(done) == list(range(TASKS))
    setup.close()


def test_unreachable_database_raises_io_error_with_the_driver_error_as_cause() -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test?connect_timeout=2"
    store = SqlTaskClaimStore(url=url, lanes=LANES)
    with pytest.raises(IoError) as error:
        store.count_active_processing_by_kinds(T0, MAIL.kinds)
    assert isinstance(error.value.__cause__, sa.exc.OperationalError)
    with pytest.raises(IoError):
        store.enqueue(1, "send_email", next_run_at=T0)
    with pytest.raises(IoError):
        store.complete(1, 1)
    with pytest.raises(IoError):
        store.create_tables()
    store.close()
