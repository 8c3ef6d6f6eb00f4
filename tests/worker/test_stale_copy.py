"""A copy whose lease is taken over while it runs: stopped, its outcome never recorded.

The holder is paused with SIGSTOP of its main process (a long GC pause, a frozen VM) for
longer than its lease; Redis restores the message, another worker takes the claim over and
runs the task; then the holder is resumed.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from tests.servers import RedisServer, missing_service
from tests.worker.helpers import unique, wait_done, wait_for
from tests.worker.lanefleet import counters, events, lanes_worker
from tests.worker.processes import Fleet, Proc

pytestmark = pytest.mark.slow


def _first(log: list[dict[str, Any]], event: str, task_id: str) -> dict[str, Any] | None:
    return next((e for e in log if e["event"] == event and e["id"] == task_id), None)


def _short(worker: object) -> str:
    return str(worker).split("@")[0]


def _pause_until_taken_over(
    holder: Proc, backend: str, queue: str, task_id: str, timeout: float = 30
) -> dict[str, Any]:
    """SIGSTOP the holder's main process until another worker starts ``task_id``."""
    os.kill(holder.popen.pid, signal.SIGSTOP)
    try:
        return wait_for(
            lambda: next(
                (
                    e
                    for e in events(backend, queue)
                    if e["event"] == "start"
                    and e["id"] == task_id
                    and _short(e["worker"]) != holder.name
                ),
                None,
            ),
            timeout=timeout,
            what="the takeover by the other worker",
        )
    finally:
        os.kill(holder.popen.pid, signal.SIGCONT)


def test_a_copy_whose_claim_is_taken_over_is_terminated_and_its_result_never_stored(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given two prefork workers and an 8 s task running on one of them (lease 3 s)
    backend, queue = private_redis.url, unique("q")
    procs = {n: lanes_worker(fleet, n, broker=backend, backend=backend, queue=queue) for n in "ab"}
    for proc in procs.values():
        proc.wait_ready()
    client = fleet.client(backend, backend, queue)
    result = client.send_task("lanes.work", (8,), task_id="stale-1")
    first = wait_for(lambda: _first(events(backend, queue), "start", "stale-1"), timeout=20)
    holder = procs[_short(first["worker"])]

    # When the holder's main process is paused past its lease until the other worker has
    # taken the claim over, and then resumed
    second = _pause_until_taken_over(holder, backend, queue, "stale-1")
    assert second["instance"] > first["instance"]

    # Then the holder's renewal is refused and its copy is terminated in the pool
    wait_for(
        lambda: (
            counters(backend, queue)
            .get(f"{holder.name}@{first['worker'].split('@')[1]}", {})
            .get("stale_terminated")
        ),
        timeout=10,
        what="the stale copy to be terminated",
    )
    # ... the new owner's result is the one stored, and stays so
    assert result.get(timeout=30).startswith(second["worker"])
    wait_done(fleet.claims(backend), queue, "stale-1:0:0")
    time.sleep(1.0)
    assert client.backend.get_task_meta("stale-1")["result"].startswith(second["worker"])
    # ... the stale copy never ended, and only the new owner's completion was recorded
    log = events(backend, queue)
    ends = [e for e in log if e["event"] == "end" and e["id"] == "stale-1"]
    assert [(e["pid"], e["instance"]) for e in ends] == [(second["pid"], second["instance"])]
    done = fleet.claims(backend).done_record(queue, "stale-1:0:0")
    assert done is not None
    assert done.instance == second["instance"]
    stats = counters(backend, queue)
    holder_stats = next(c for n, c in stats.items() if n.startswith(f"{holder.name}@"))
    assert holder_stats["lease_lost"] == 1
    assert holder_stats.get("completed", 0) == 0
    assert "terminated lanes.work[stale-1]" in holder.output()


# --- fencing a PostgreSQL write -------------------------------------------------------------


@pytest.fixture
def pg_table() -> Iterator[tuple[str, str]]:
    """A fresh table ``(id, writer, fence)`` in the machine's PostgreSQL; dropped afterwards."""
    from tests.lanes.conftest import _connectable_postgres_url

    url = _connectable_postgres_url()
    if url is None:
        missing_service("PostgreSQL at 127.0.0.1:5432 (database test)")
    assert url is not None
    name = unique("fenced").replace("-", "_")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    f"CREATE TABLE {name} (id integer PRIMARY KEY, writer text NOT NULL, "
                    f"fence bigint NOT NULL)"
                )
            )
        yield url, name
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        engine.dispose()


@pytest.mark.postgres
def test_two_copies_racing_after_a_takeover_leave_only_the_newer_instances_write(
    fleet: Fleet, private_redis: RedisServer, pg_table: tuple[str, str]
) -> None:
    # Given a solo worker (it cannot terminate a stale copy) running a task that sleeps 6 s
    # and then writes its row to PostgreSQL guarded by its claim instance
    url, table = pg_table
    backend, queue = private_redis.url, unique("q")
    env = {"CLAIMS_TEST_PG": url, "CLAIMS_TEST_PG_TABLE": table}
    first_worker = lanes_worker(
        fleet, "a", broker=backend, backend=backend, queue=queue, pool="solo", concurrency=1,
        env=env,
    ).wait_ready()  # fmt: skip
    client = fleet.client(backend, backend, queue)
    result = client.send_task("lanes.fenced_write", (1, 6), task_id="fence-1")
    first = wait_for(lambda: _first(events(backend, queue), "start", "fence-1"), timeout=20)

    # When it is paused past its lease, while a second worker starts, takes the task over and
    # writes; and then resumes and writes too (after the newer copy)
    os.kill(first_worker.popen.pid, signal.SIGSTOP)
    try:
        lanes_worker(
            fleet, "b", broker=backend, backend=backend, queue=queue, concurrency=1, env=env
        ).wait_ready()
        written = wait_for(
            lambda: _first(events(backend, queue), "written", "fence-1"),
            timeout=40,
            what="the newer copy's write",
        )
    finally:
        os.kill(first_worker.popen.pid, signal.SIGCONT)
    second = next(
        e
        for e in events(backend, queue)
        if e["event"] == "start" and e["id"] == "fence-1" and e["pid"] == written["pid"]
    )
    refused = wait_for(
        lambda: _first(events(backend, queue), "refused", "fence-1"), timeout=20, what="A's write"
    )

    # Then the row holds the newer instance's write; the stale copy's write was refused
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            row = conn.execute(sa.text(f"SELECT writer, fence FROM {table} WHERE id = 1")).one()
    finally:
        engine.dispose()
    assert row.fence == second["instance"] > first["instance"]
    assert row.writer.startswith(second["worker"])
    assert refused["instance"] == first["instance"]
    # ... and the stale copy's result was discarded: the stored result is the newer copy's
    assert result.get(timeout=20) == second["worker"]
    time.sleep(1.0)
    assert client.backend.get_task_meta("fence-1")["result"] == second["worker"]
    assert "result discarded" in first_worker.output()
