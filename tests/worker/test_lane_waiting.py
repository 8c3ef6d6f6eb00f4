"""A message waiting for its lane, in one in-process worker: its claim and a lost lease."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_claims import RedisClaimManager
from celery_claims.worker import lease_lost, task_held
from tests.servers import RedisServer
from tests.worker.helpers import close_app, in_process_worker, make_app, unique, wait_for


@pytest.fixture
def paused_app(redis_server: RedisServer, queue: str, key_prefix: str) -> Iterator[Celery]:
    """An app whose only queue is a lane of limit 0 (paused): its messages always wait."""
    app = make_app(
        redis_server.url,
        queue=queue,
        claims_prefix=key_prefix,
        claims_lanes={"paused": {"queues": [queue], "limit": 0}},
    )

    @app.task(shared=False, name="t.lane_noop")
    def lane_noop() -> str:
        return "ran"

    try:
        yield app
    finally:
        close_app(app)


def test_a_waiting_message_whose_claim_is_taken_over_waits_again_as_a_held_duplicate(
    paused_app: Celery, queue: str, claims: RedisClaimManager
) -> None:
    # Given a message waiting for a paused lane, holding its claim
    events: list[tuple[str, str]] = []

    def on_held(sender: Any = None, reason: str = "", **_: Any) -> None:
        events.append(("held", reason))

    def on_lost(sender: Any = None, **_: Any) -> None:
        events.append(("lost", ""))

    task_held.connect(on_held, weak=False)
    lease_lost.connect(on_lost, weak=False)
    task_id = unique("wait")
    try:
        with in_process_worker(paused_app) as worker:
            paused_app.tasks["t.lane_noop"].apply_async(task_id=task_id)
            mine = wait_for(
                lambda: next(iter(claims.list_claims(queue)), None), timeout=10, what="the claim"
            )
            wait_for(lambda: ("held", "lane") in events, timeout=10, what="the lane hold")

            # When another owner takes its claim over
            claims.release(mine)
            thief = claims.claim(queue, f"{task_id}:0:0", "thief/1/x", 60_000)
            assert thief.token is not None

            # Then the worker sees the lease lost, takes the message out of the lane, and
            # holds it as a duplicate of the new owner's copy (not run, not acked)
            wait_for(lambda: ("held", "held") in events, timeout=10, what="the duplicate hold")
            counters = worker.claims.counters.snapshot()
            assert counters["lease_lost"] == 1
            assert counters.get("lane_acquired", 0) == 0
            assert events.index(("lost", "")) < events.index(("held", "held"))
            # ... and the new owner's claim is untouched
            assert claims.is_claimed(queue, f"{task_id}:0:0") == (
                "thief/1/x",
                thief.token.expires_at,
            )
    finally:
        task_held.disconnect(on_held)
        lease_lost.disconnect(on_lost)
