"""Lane tickets of workers that are gone are purged, and a live worker whose ticket was purged
takes a new one; one in-process worker on a private Redis (broker, results, claims, lanes)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery

from celery_claims.lanes import TaskClaimCandidate, TaskLaneConfig
from celery_claims.lanes.redis import RedisTaskClaimStore
from celery_claims.worker.delivery.lane_model import LaneWaiter
from celery_claims.worker.delivery.lane_tickets import TICKET_GRACE_LEASES, claim_slots
from celery_claims.worker.delivery.lanes import WorkerLanes
from celery_claims.worker.settings import load_settings
from celery_claims.worker.signals import Counters
from tests.servers import RedisServer
from tests.worker.helpers import (
    LEASE_MS,
    close_app,
    in_process_worker,
    make_app,
    paused_task,
    wait_for,
)

#: The lane of these tests, as the worker registers it in the lane store.
EXPORTS = TaskLaneConfig(lane="exports", kinds=("exports",), limit=1)


@pytest.fixture
def lane_app(redis_server: RedisServer, queue: str, key_prefix: str) -> Iterator[Celery]:
    """An app whose queue is lane ``exports`` (limit 1), with a task that returns at once."""
    app = make_app(
        redis_server.url,
        queue=queue,
        claims_prefix=key_prefix,
        claims_lanes={"exports": {"queues": [queue], "limit": 1}},
    )

    @app.task(shared=False, name="t.lane_quick")
    def lane_quick() -> str:
        return "ran"

    try:
        yield app
    finally:
        close_app(app)


@pytest.fixture
def store(redis_server: RedisServer, key_prefix: str) -> Iterator[RedisTaskClaimStore]:
    """The worker's lane store, seen by the test."""
    lanes = RedisTaskClaimStore(client=redis_server.client(), lanes=[EXPORTS], prefix=key_prefix)
    try:
        yield lanes
    finally:
        lanes.client.close()


def _purge_everything(store: RedisTaskClaimStore) -> list[int]:
    """Purge as a purge an hour from now would: as if the worker had stalled past the grace."""
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    future = RedisTaskClaimStore(
        client=store.client, lanes=[EXPORTS], prefix=store.prefix, clock=lambda: later
    )
    return future.purge_stale(EXPORTS, stale_before=later, limit=100)


def _gone_workers_ticket(store: RedisTaskClaimStore, key: str) -> int:
    """A ticket as a SIGKILLed worker leaves it: processing, holding ``key``, its lease over
    for much longer than the grace."""
    ticket = 4242
    long_ago = datetime.now(timezone.utc) - timedelta(
        milliseconds=LEASE_MS * (TICKET_GRACE_LEASES + 10)
    )
    store.enqueue(ticket, "exports", next_run_at=long_ago - timedelta(seconds=1))
    store.claim_candidates_for_lane(
        EXPORTS,
        [TaskClaimCandidate(0, ticket, 0, 1)],
        long_ago,
        long_ago,
        long_ago + timedelta(milliseconds=LEASE_MS),
        keys=[key],
        limit_per_key=1,
    )
    return ticket


def test_a_worker_whose_free_ticket_was_purged_takes_a_new_one_for_its_next_message(
    lane_app: Celery, store: RedisTaskClaimStore
) -> None:
    quick = lane_app.tasks["t.lane_quick"]
    with in_process_worker(lane_app) as worker:
        # Given a worker whose one lane ticket, given back after its first task, was purged
        assert quick.apply_async().get(timeout=20) == "ran"
        wait_for(
            lambda: worker.claims.counters.get("lane_released") == 1,
            timeout=10,
            what="the ticket given back",
        )
        assert len(_purge_everything(store)) == 1

        # When its next lane message arrives
        result = quick.apply_async()

        # Then it runs: the worker dropped the vanished ticket and made a new one
        assert result.get(timeout=20) == "ran"
        counters = worker.claims.counters.snapshot()
        assert counters["lane_tickets_vanished"] == 1
        assert counters["lane_tickets"] == 2
        assert counters.get("lane_unavailable", 0) == 0


def test_a_running_tasks_purged_ticket_is_not_reused_after_the_task(
    lane_app: Celery, store: RedisTaskClaimStore
) -> None:
    quick = lane_app.tasks["t.lane_quick"]
    task, gate = paused_task(lane_app, "t.lane_paused")
    with in_process_worker(lane_app) as worker:
        # Given a running lane task whose ticket was purged (its worker stalled past the grace)
        first = task.apply_async()
        assert gate.started.wait(20)
        assert len(_purge_everything(store)) == 1

        # When it ends, and another lane message arrives
        gate.release.set()
        assert first.get(timeout=20) == "done"
        result = quick.apply_async()

        # Then that one runs on a new ticket: the release dropped the purged one, rather than
        # keeping it for the next message
        assert result.get(timeout=20) == "ran"
        counters = worker.claims.counters.snapshot()
        assert counters["lane_tickets"] == 2
        assert counters.get("lane_tickets_vanished", 0) == 0
        assert counters.get("lane_unavailable", 0) == 0


def test_a_starting_worker_purges_a_gone_workers_ticket_and_its_key(
    lane_app: Celery, store: RedisTaskClaimStore
) -> None:
    # Given the ticket a SIGKILLed worker left, with its tenant's key
    ticket = _gone_workers_ticket(store, "t-gone")

    # When a worker of the lane starts
    with in_process_worker(lane_app) as worker:
        # Then it purges that ticket: record, key name and index entry
        wait_for(lambda: store.get_task(ticket) is None, timeout=20, what="the purge")
        assert worker.claims.counters.get("lane_tickets_purged") == 1
    tasks = store.client.hvals(store.lane_keys("exports").tasks)
    assert not any(b"t-gone" in value for value in tasks)


def test_the_cleanup_task_purges_a_gone_workers_ticket(
    lane_app: Celery, store: RedisTaskClaimStore
) -> None:
    # Given the ticket a SIGKILLed worker left, and no worker running
    ticket = _gone_workers_ticket(store, "t-gone")
    live = store.enqueue(99, "exports")  # a ticket given back just now: kept

    # When the beat cleanup task runs
    lane_app.tasks["celery_claims.cleanup_expired"]()

    # Then the gone worker's ticket is purged, the fresh one kept
    assert store.get_task(ticket) is None
    assert store.get_task(99) == live


def test_a_workers_lane_pass_claims_only_the_slots_the_fleet_leaves(
    lane_app: Celery, store: RedisTaskClaimStore
) -> None:
    # Given a worker's lanes, a message of it waiting for lane exports (limit 1), and a gone
    # worker's ticket whose lease is still live: the lane is full, fleet-wide
    lanes = WorkerLanes(load_settings(lane_app), store, Counters())
    lane = lanes.lanes["exports"]
    waiter = LaneWaiter(request=None, claim=None)
    now = datetime.now(timezone.utc)
    store.enqueue(4343, "exports", next_run_at=now - timedelta(seconds=1))
    other = store.claim_candidates_for_lane(
        EXPORTS, [TaskClaimCandidate(0, 4343, 0, 1)], now, now, now + timedelta(minutes=1)
    )

    # When the worker's pass offers its waiting message
    full = claim_slots(lanes, lane, [waiter], stale_secs=60)

    # Then it is granted nothing (the store counted the fleet's live slot), its ticket made
    assert full == []
    assert waiter.ticket is not None

    # And once the other slot is given back, the next pass grants it, with its new token
    store.complete(4343, other[0].processing_token)
    assert claim_slots(lanes, lane, [waiter], stale_secs=60) == [(waiter, 1)]
