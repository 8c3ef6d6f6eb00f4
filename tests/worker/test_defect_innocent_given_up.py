"""Defect: an innocent task was given up as poison because its holders kept dying before
they started it.

Found by the chaos soak (seed 11, under heavy load): task t0077 was given up, never having
run. Four of its holders had died (SIGKILLed with the task still claimed in their prefetch,
waiting for a pool process), and the takeover limit counted every takeover. Only a holder
that started the task can have died of it: a takeover's claim now counts toward
``claims_max_takeovers`` once the process running it has marked its start.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_claims import AlreadyDone, RedisClaimManager, TookOver
from celery_claims.fencing import TaskClaim
from celery_claims.worker.delivery.guard import ClaimUnverified, declare_request_key, guard_tasks
from celery_claims.worker.settings import load_settings
from tests.servers import RedisServer
from tests.worker.helpers import close_app, in_process_worker, make_app, unique, wait_done

DEAD_LEASE_MS = 50


@pytest.fixture
def app(
    redis_server: RedisServer, queue: str, key_prefix: str, claims: RedisClaimManager
) -> Iterator[Celery]:
    app = make_app(redis_server.url, queue=queue, claims_prefix=key_prefix, claims_max_takeovers=1)

    @app.task(bind=True, shared=False, name="t.own_entry")
    def own_entry(self: Any) -> list[Any]:
        # what the store holds for this attempt while its body runs (the start mark is sent
        # without waiting for its reply, on a connection of its own: it may land a moment
        # after this read's, so look until it is there)
        claim = self.request.claim
        deadline = time.monotonic() + 5
        while True:
            [stored] = claims.read(claim.queue_id, [claim.task_id])
            if not stored.start_unmarked or time.monotonic() > deadline:
                return [claim.mark_start, stored.start_unmarked, stored.takeovers]
            time.sleep(0.05)

    try:
        yield app
    finally:
        close_app(app)


def died_before_starting(claims: RedisClaimManager, queue: str, task_key: str) -> None:
    """The store's footprint of a first holder that died, then of a takeover's holder that
    died before its pool started the task, both under a limit of one takeover."""
    claims.claim_unless_done(queue, task_key, "dead/1/x.1", DEAD_LEASE_MS, max_takeovers=1)
    time.sleep(DEAD_LEASE_MS * 2 / 1000)
    took_over = claims.claim_unless_done(
        queue, task_key, "dead/2/y.1", DEAD_LEASE_MS, max_takeovers=1
    )
    assert isinstance(took_over, TookOver)
    time.sleep(DEAD_LEASE_MS * 2 / 1000)


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_a_task_whose_holders_died_before_starting_it_runs_and_marks_its_start(
    pool: str, app: Celery, queue: str, claims: RedisClaimManager
) -> None:
    # Given a task whose first holder died and whose takeover holder died before starting it,
    # with claims_max_takeovers = 1
    task_id = unique("innocent")
    key = f"{task_id}:0:0"
    died_before_starting(claims, queue, key)

    # When a worker gets its message
    with in_process_worker(app, pool=pool, concurrency=2 if pool == "threads" else 1):
        seen = app.tasks["t.own_entry"].apply_async(task_id=task_id).get(timeout=20)

    # Then it took the task over and ran it (the holder that never started it did not count:
    # the task was not given up), and its own claim was marked started before the body ran,
    # so that its death would have counted
    assert seen == [True, False, 1]
    assert isinstance(wait_done(claims, queue, key), AlreadyDone)


def test_a_taken_over_claim_whose_start_the_store_cannot_take_does_not_run(
    private_redis: RedisServer, queue: str, key_prefix: str
) -> None:
    # A start mark sent without waiting was lost when the store was down or restarting: the
    # holder of a poison task then did not count, and a soak run saw it run 6 times under a
    # limit of 4. The mark is now waited for, and a taken-over copy whose start the store
    # cannot take does not start (fail closed).
    # Given a taken-over claim under a takeover limit, handed to the guarded task body
    app = make_app(
        private_redis.url, queue=queue, claims_prefix=key_prefix, claims_max_takeovers=1,
        claims_start_timeout_ms=3000,
    )  # fmt: skip
    ran: list[int] = []

    @app.task(bind=True, shared=False, name="t.body")
    def body(self: Any) -> None:
        ran.append(1)

    manager = RedisClaimManager(url=private_redis.url, prefix=key_prefix)
    try:
        declare_request_key()
        guard_tasks(app, load_settings(app), manager)
        key = f"{unique('marked')}:0:0"
        manager.claim_unless_done(queue, key, "dead/1/x.1", DEAD_LEASE_MS, max_takeovers=1)
        time.sleep(DEAD_LEASE_MS * 2 / 1000)
        took_over = manager.claim_unless_done(queue, key, "w/1/y.1", 60_000, max_takeovers=1)
        assert isinstance(took_over, TookOver)
        claim = TaskClaim.of(took_over.token, 60_000, mark_start=True)

        # When the store is gone as the body is about to start
        private_redis.stop(signal.SIGKILL)
        body.push_request(id=key, claim=claim)
        try:
            # Then the copy does not start: its claim's start could not be marked
            with pytest.raises(ClaimUnverified):
                body.run()
        finally:
            body.pop_request()
        assert ran == []
    finally:
        manager.close()
        close_app(app)
