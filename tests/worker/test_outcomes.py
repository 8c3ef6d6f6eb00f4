"""Gate outcomes with in-process workers: done copies, retries, replace(), opt-outs, holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_claims import RedisClaimManager
from celery_claims.worker import signals
from tests.servers import RedisServer, on_every_server
from tests.worker.helpers import (
    LEASE_MS,
    close_app,
    in_process_worker,
    make_app,
    wait_done,
    wait_for,
)


class Recorder:
    """Executions seen by tasks running in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, Any]] = []

    def add(self, name: str, value: Any) -> None:
        with self.lock:
            self.calls.append((name, value))

    def of(self, name: str) -> list[Any]:
        with self.lock:
            return [v for n, v in self.calls if n == name]


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def app(
    store_server: RedisServer, queue: str, key_prefix: str, recorder: Recorder
) -> Iterator[Celery]:
    app = make_app(store_server.url, queue=queue, claims_prefix=key_prefix)

    @app.task(shared=False, name="t.echo")
    def echo(value: Any) -> Any:
        recorder.add("echo", value)
        return value

    @app.task(shared=False, name="t.retry_once", bind=True)
    def retry_once(self: Any) -> str:
        recorder.add("retry_once", self.request.retries)
        if self.request.retries == 0:
            raise self.retry(countdown=0, max_retries=3)
        return "second"

    @app.task(shared=False, name="t.replaced", bind=True)
    def replaced(self: Any) -> Any:
        recorder.add("replaced", self.request.id)
        return self.replace(echo.si("from-replacement"))

    @app.task(shared=False, name="t.long_lease", claims_lease_ms=7000)
    def long_lease() -> str:
        return "ok"

    @app.task(shared=False, name="t.limited", rate_limit="100/s")
    def limited() -> str:
        return "limited"

    @app.task(shared=False, name="t.unclaimed", claims=False)
    def unclaimed(value: Any) -> Any:
        recorder.add("unclaimed", value)
        return value

    try:
        yield app
    finally:
        close_app(app)


class Captured:
    """Signal receivers that keep what they were sent."""

    def __init__(self) -> None:
        self.skipped: list[dict[str, Any]] = []
        self.held: list[dict[str, Any]] = []

    def on_skipped(self, sender: Any = None, **kwargs: Any) -> None:
        self.skipped.append(kwargs)

    def on_held(self, sender: Any = None, **kwargs: Any) -> None:
        self.held.append(kwargs)


@pytest.fixture
def captured() -> Any:
    seen = Captured()
    signals.task_skipped.connect(seen.on_skipped, weak=False)
    signals.task_held.connect(seen.on_held, weak=False)
    try:
        yield seen
    finally:
        signals.task_skipped.disconnect(seen.on_skipped)
        signals.task_held.disconnect(seen.on_held)


@on_every_server
def test_resent_completed_task_is_acked_without_running_and_keeps_the_first_result(
    app: Celery, recorder: Recorder, captured: Captured, store_server: RedisServer, queue: str
) -> None:
    # Given a task that completed once
    echo = app.tasks["t.echo"]
    with in_process_worker(app) as worker:
        first = echo.apply_async(("first",), task_id="done-1")
        assert first.get(timeout=10) == "first"

        # When a copy with the same task id arrives (with other arguments, to tell them apart)
        echo.apply_async(("second",), task_id="done-1")
        wait_for(lambda: captured.skipped, timeout=10, what="the skip signal")

        # Then it is acked without running, visibly, and the stored result is the first one
        assert recorder.of("echo") == ["first"]
        assert worker.claims.counters.get("skipped_done") == 1
        assert captured.skipped[0]["reason"] == "done"
        assert app.AsyncResult("done-1").get(timeout=5) == "first"
        client = store_server.client()
        assert client.llen(queue) == 0
        assert client.hlen("unacked") == 0


@on_every_server
def test_retry_with_countdown_zero_runs_the_next_attempt_but_not_a_duplicate_of_the_first(
    app: Celery, recorder: Recorder, claims: RedisClaimManager, queue: str
) -> None:
    # Given a task that retries once with countdown 0
    retry_once = app.tasks["t.retry_once"]
    with in_process_worker(app) as worker:
        # When it runs
        result = retry_once.apply_async(task_id="retry-1")

        # Then the retry (same task id, next attempt) runs and succeeds
        assert result.get(timeout=10) == "second"
        assert recorder.of("retry_once") == [0, 1]
        wait_done(claims, queue, "retry-1:0:0")
        wait_done(claims, queue, "retry-1:1:0")

        # And a late duplicate of the first attempt is not re-run
        retry_once.apply_async(task_id="retry-1")
        wait_for(
            lambda: worker.claims.counters.get("skipped_done") == 1, timeout=10, what="the skip"
        )
        assert recorder.of("retry_once") == [0, 1]
        assert app.AsyncResult("retry-1").get(timeout=5) == "second"


def test_replace_runs_the_replacement_but_not_a_duplicate_of_the_replaced_attempt(
    app: Celery, recorder: Recorder, claims: RedisClaimManager, queue: str
) -> None:
    # Given a task that replaces itself with another task (same task id, nesting 1)
    replaced = app.tasks["t.replaced"]
    with in_process_worker(app) as worker:
        # When it runs
        result = replaced.apply_async(task_id="replace-1")

        # Then the replacement runs and its result is the task's result
        assert result.get(timeout=10) == "from-replacement"
        assert recorder.of("replaced") == ["replace-1"]
        assert recorder.of("echo") == ["from-replacement"]
        wait_done(claims, queue, "replace-1:0:1")

        # And a late duplicate of the replaced attempt does not run again
        replaced.apply_async(task_id="replace-1")
        wait_for(
            lambda: worker.claims.counters.get("skipped_done") == 1, timeout=10, what="the skip"
        )
        assert recorder.of("replaced") == ["replace-1"]
        assert recorder.of("echo") == ["from-replacement"]


def test_a_caller_waiting_on_a_task_that_replaces_itself_gets_the_replacement_result(
    app: Celery, recorder: Recorder, claims: RedisClaimManager, queue: str
) -> None:
    # Given a task that replaces itself only once its caller is waiting on its result: replace()
    # makes and drops an AsyncResult of the same id in the worker thread, which on Celery 5.3
    # to 5.6 ends every wait on that id in the backend it was made with (Celery #4925)
    caller_waits = threading.Event()

    @app.task(shared=False, name="t.replaced_while_waited", bind=True)
    def replaced_while_waited(self: Any) -> Any:
        caller_waits.wait(10)
        return self.replace(app.tasks["t.echo"].si("from-replacement"))

    with in_process_worker(app):
        # When the caller waits on it
        result = replaced_while_waited.apply_async(task_id="replace-waited-1")

        # Then it gets the replacement's result
        assert result.get(timeout=10, on_interval=caller_waits.set) == "from-replacement"
        assert recorder.of("echo") == ["from-replacement"]
        wait_done(claims, queue, "replace-waited-1:0:1")


def test_opted_out_and_celery_tasks_run_every_copy_without_a_claim(
    app: Celery, recorder: Recorder, claims: RedisClaimManager
) -> None:
    # Given a task with claims = False and the package's own cleanup task
    unclaimed = app.tasks["t.unclaimed"]
    cleanup = app.tasks["celery_claims.cleanup_expired"]
    with in_process_worker(app) as worker:
        # When two copies with one task id arrive, and the cleanup task runs twice
        unclaimed.apply_async((1,), task_id="free-1")
        unclaimed.apply_async((2,), task_id="free-1")
        cleanup.apply_async(task_id="cleanup-1")
        cleanup.apply_async(task_id="cleanup-2")

        # Then every copy ran and the claim store was never asked
        wait_for(lambda: len(recorder.of("unclaimed")) == 2, timeout=10, what="both copies")
        assert app.AsyncResult("cleanup-2").get(timeout=10) == 0
        assert app.AsyncResult("cleanup-1").get(timeout=10) == 0
        assert sorted(recorder.of("unclaimed")) == [1, 2]
        assert claims.stats().attempts == 0
        assert worker.claims.counters.snapshot() == {}


@on_every_server
def test_copy_held_by_a_live_lease_waits_then_is_acked_when_the_holder_completes(
    app: Celery, recorder: Recorder, claims: RedisClaimManager, captured: Captured, queue: str
) -> None:
    # Given another worker holds the claim of a task
    echo = app.tasks["t.echo"]
    holder = claims.claim(queue, "held-1:0:0", "elsewhere/1/x", 60_000)
    assert holder.token is not None
    with in_process_worker(app) as worker:
        # When a copy of the task arrives
        echo.apply_async(("copy",), task_id="held-1")

        # Then it is held, visibly, and does not run
        wait_for(lambda: captured.held, timeout=10, what="the held signal")
        assert captured.held[0]["reason"] == "held"
        assert captured.held[0]["holder"] == "elsewhere/1/x"
        # (for longer than the broker's visibility timeout: the keeper refreshes the held
        # delivery in unacked_index, so Redis does not restore and redeliver it)
        wait_for(
            lambda: worker.claims.counters.get("rechecks") >= 16,
            timeout=20,
            what="re-checks past the visibility timeout",
        )
        assert recorder.of("echo") == []
        assert worker.claims.counters.get("held") == 1, "the held copy was redelivered"
        assert worker.claims.counters.get("unacked_refreshed") > 0

        # And when the holder records completion, the held copy is acked without running
        claims.complete(holder.token, 60_000)
        wait_for(lambda: captured.skipped, timeout=10, what="the skip signal")
        assert recorder.of("echo") == []
        assert worker.claims.counters.get("held") == 1


@on_every_server
def test_copy_held_by_a_dead_holder_is_taken_over_when_its_lease_expires(
    app: Celery, recorder: Recorder, claims: RedisClaimManager, queue: str
) -> None:
    # Given a holder that claimed the task with a short lease and then died
    echo = app.tasks["t.echo"]
    claims.claim(queue, "orphan-1:0:0", "dead/1/x", 1500)
    with in_process_worker(app) as worker:
        # When a copy arrives
        result = echo.apply_async(("rescued",), task_id="orphan-1")

        # Then it is held until the lease expires, then taken over and run once
        assert result.get(timeout=15) == "rescued"
        assert recorder.of("echo") == ["rescued"]
        counters = worker.claims.counters.snapshot()
        assert counters["held"] == 1
        assert counters["took_over"] == 1
        wait_done(claims, queue, "orphan-1:0:0")


def test_eta_rate_limited_and_per_task_lease_requests_all_pass_the_gate(
    app: Celery, claims: RedisClaimManager, queue: str
) -> None:
    # Given a countdown request, a rate-limited task and a task with its own lease
    acquired: dict[str, Any] = {}

    def on_acquired(sender: Any = None, **kwargs: Any) -> None:
        acquired[kwargs["request"].id] = kwargs["token"]

    signals.claim_acquired.connect(on_acquired, weak=False)
    try:
        with in_process_worker(app) as worker:
            # When they run
            eta = app.tasks["t.echo"].apply_async(("eta",), countdown=0.5, task_id="eta-1")
            limited = app.tasks["t.limited"].apply_async(task_id="limited-1")
            long_lease = app.tasks["t.long_lease"].apply_async(task_id="lease-1")
            assert eta.get(timeout=10) == "eta"
            assert limited.get(timeout=10) == "limited"
            assert long_lease.get(timeout=10) == "ok"

            # Then each was claimed by the gate and recorded done
            for task_id in ("eta-1", "limited-1", "lease-1"):
                wait_done(claims, queue, f"{task_id}:0:0")
            assert worker.claims.counters.get("acquired") == 3
    finally:
        signals.claim_acquired.disconnect(on_acquired)

    # And the task with its own lease was claimed for that lease, the others for the default
    lease = acquired["lease-1"]
    assert lease.expires_at - lease.created_at == 7000
    default = acquired["eta-1"]
    assert default.expires_at - default.created_at == LEASE_MS


def test_cleanup_task_removes_expired_claims_up_to_its_limit(
    app: Celery, claims: RedisClaimManager, queue: str
) -> None:
    # Given three claims whose leases have expired and one live claim
    for n in range(3):
        claims.claim(queue, f"stale-{n}", "gone/1/x", 1)
    claims.claim(queue, "live", "here/1/x", 60_000)
    time.sleep(0.01)
    cleanup = app.tasks["celery_claims.cleanup_expired"]
    with in_process_worker(app):
        # When the cleanup task runs with a limit of 2, then again without one
        first = cleanup.apply_async((2,)).get(timeout=10)
        second = cleanup.apply_async().get(timeout=10)

    # Then it removed two, then the last one, and left the live claim alone
    assert (first, second) == (2, 1)
    assert [t.task_id for t in claims.list_claims(queue)] == ["live"]


@pytest.mark.slow
def test_gate_keeps_claiming_after_the_broker_connection_restarts(
    private_redis: RedisServer, queue: str, key_prefix: str
) -> None:
    # Given a worker whose broker (and claim store) is a private Redis
    app = make_app(
        private_redis.url,
        queue=queue,
        claims_prefix=key_prefix,
        # Celery 6's default; Celery 5.7 warns on connection loss without it
        worker_cancel_long_running_tasks_on_connection_loss=True,
    )
    claims = RedisClaimManager(url=private_redis.url, prefix=key_prefix)

    @app.task(shared=False, name="t.echo")
    def echo(value: Any) -> Any:
        return value

    try:
        with in_process_worker(app) as worker:
            assert echo.apply_async(("before",), task_id="before").get(timeout=10) == "before"

            # When the broker restarts under it and the consumer reconnects
            private_redis.restart()
            result = echo.apply_async(("after",), task_id="after")

            # Then tasks still go through the gate
            assert result.get(timeout=60) == "after"
            assert worker.consumer.restart_count >= 1, "the consumer did not restart"
            wait_done(claims, queue, "after:0:0")
            assert worker.claims.counters.get("acquired") == 2
    finally:
        claims.client.close()
        close_app(app)
