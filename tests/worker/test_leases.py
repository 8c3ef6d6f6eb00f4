"""The lease keeper with in-process workers: renewal on solo and threads, lease loss."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_claims import ClaimToken, RedisClaimManager
from celery_claims.worker import signals
from tests.servers import RedisServer
from tests.worker.helpers import (
    LEASE_MS,
    RENEW_INTERVAL_MS,
    close_app,
    in_process_worker,
    make_app,
    wait_for,
)


def server_now_ms(manager: RedisClaimManager) -> int:
    """The claim store's clock (the clock leases are judged by)."""
    seconds, micros = manager.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def sample_remaining_lease(
    manager: RedisClaimManager, queue: str, task_key: str, until: threading.Event
) -> list[int]:
    """Remaining lease of the task's claim, sampled every 50 ms until ``until`` is set."""
    samples: list[int] = []
    while not until.is_set():
        now = server_now_ms(manager)
        tokens = [t for t in manager.list_claims(queue) if t.task_id == task_key]
        if tokens:
            samples.append(tokens[0].expires_at - now)
        time.sleep(0.05)
    return samples


@pytest.fixture
def app(redis_server: RedisServer, queue: str, key_prefix: str) -> Iterator[Celery]:
    app = make_app(redis_server.url, queue=queue, claims_prefix=key_prefix)

    @app.task(shared=False, name="t.sleep")
    def sleep(seconds: float) -> float:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.05)
        return seconds

    try:
        yield app
    finally:
        close_app(app)


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_remaining_lease_never_drops_below_lease_minus_two_renew_intervals(
    pool: str,
    app: Celery,
    queue: str,
    claims: RedisClaimManager,
) -> None:
    # Given a worker of the pool under test and a 10 s task
    with in_process_worker(app, pool=pool, concurrency=2) as worker:
        result = app.tasks["t.sleep"].apply_async((10,), task_id=f"renew-{pool}")
        wait_for(lambda: claims.list_claims(queue), timeout=10, what="the claim")

        # When the lease is sampled from outside while the task runs
        done = threading.Event()
        sampled: list[int] = []
        sampler = threading.Thread(
            target=lambda: sampled.extend(
                sample_remaining_lease(claims, queue, f"renew-{pool}:0:0", done)
            )
        )
        sampler.start()
        try:
            assert result.get(timeout=30) == 10
        finally:
            done.set()
            sampler.join()

        # Then the remaining lease never fell below lease - 2 x renew interval
        assert len(sampled) > 50, "the claim was not observed while the task ran"
        assert min(sampled) >= LEASE_MS - 2 * RENEW_INTERVAL_MS, min(sampled)
        assert worker.claims.counters.get("renewals") >= 10
        assert claims.list_claims(queue) == []


def test_lost_lease_fences_the_request_so_neither_its_success_nor_its_result_is_recorded(
    app: Celery, queue: str, claims: RedisClaimManager
) -> None:
    # Given a task running under a claim, and a receiver of lease_lost that notes whether
    # the worker's copy of the signalled request is fenced as it is signalled
    lost: list[dict[str, Any]] = []
    workers: list[Any] = []

    def on_lost(sender: Any = None, **kwargs: Any) -> None:
        copies = workers[0].claims.life.reg.copies()
        kwargs["fenced"] = [c.fenced for c in copies if c.request is kwargs["request"]]
        lost.append(kwargs)

    signals.lease_lost.connect(on_lost, weak=False)
    try:
        with in_process_worker(app) as worker:
            workers.append(worker)
            result = app.tasks["t.sleep"].apply_async((3,), task_id="fenced-1")
            mine: ClaimToken = wait_for(
                lambda: next(iter(claims.list_claims(queue)), None), timeout=10, what="the claim"
            )

            # When another owner takes the claim while the task runs
            claims.release(mine)
            thief = claims.claim(queue, "fenced-1:0:0", "thief/1/x", 60_000)
            assert thief.token is not None

            # Then the keeper notices, fences the request and signals it
            wait_for(lambda: lost, timeout=5, what="the lease_lost signal")
            assert lost[0]["token"].instance == mine.instance
            assert lost[0]["fenced"] == [True]
            wait_for(
                lambda: worker.claims.counters.get("fenced_success"),
                timeout=10,
                what="the stale copy's end",
            )

            # And neither its success nor its result is recorded (the solo pool cannot stop
            # it, so the guard around the task discards its outcome); the new owner's claim
            # is untouched
            assert result.state == "PENDING"
            assert claims.done_record(queue, "fenced-1:0:0") is None
            assert claims.is_claimed(queue, "fenced-1:0:0") == ("thief/1/x", thief.token.expires_at)
            counters = worker.claims.counters.snapshot()
            assert counters["lease_lost"] == 1
            assert counters["fenced_success"] == 1
    finally:
        signals.lease_lost.disconnect(on_lost)
