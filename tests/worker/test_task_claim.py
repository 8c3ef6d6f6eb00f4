"""The claim in task code (``self.request.claim``, ``current_claim()``) in every pool, the
startup safety check, and the small hooks ``install`` adds."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_claims import RedisClaimManager
from celery_claims.fencing import TaskClaim
from celery_claims.worker import claim_acquired, current_claim, history_connected
from celery_claims.worker.delivery.guard import SETTLE_KEY
from tests.servers import RedisServer, on_every_server
from tests.worker.helpers import close_app, in_process_worker, make_app, unique, wait_done
from tests.worker.lanefleet import events, lanes_worker
from tests.worker.processes import ROOT, Fleet


@pytest.fixture
def app(store_server: RedisServer, queue: str, key_prefix: str) -> Iterator[Celery]:
    app = make_app(store_server.url, queue=queue, claims_prefix=key_prefix)

    @app.task(bind=True, shared=False, name="t.whoami")
    def whoami(self: Any) -> list[Any]:
        claim = current_claim()
        assert claim is not None
        return [self.request.claim.instance, claim.instance, claim.queue_id, claim.task_id]

    @app.task(bind=True, shared=False, name="t.unclaimed", claims=False)
    def unclaimed(self: Any) -> list[Any]:
        return [self.request.claim, current_claim()]

    try:
        yield app
    finally:
        close_app(app)


@on_every_server
@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_task_code_sees_its_claim_and_fencing_number_in_thread_and_solo_pools(
    pool: str, app: Celery, queue: str, claims: RedisClaimManager
) -> None:
    # Given a worker of the pool (task ids unique: the result backend is shared by tests)
    task_id = unique("who")
    with in_process_worker(app, pool=pool, concurrency=2 if pool == "threads" else 1):
        # When a claimed task and an unclaimed one run
        seen = app.tasks["t.whoami"].apply_async(task_id=task_id).get(timeout=20)
        none = app.tasks["t.unclaimed"].apply_async(task_id=unique("who")).get(timeout=20)

    # Then the claimed one saw its own claim, whose instance is the one recorded done
    done = wait_done(claims, queue, f"{task_id}:0:0")
    assert seen == [done.instance, done.instance, queue, f"{task_id}:0:0"]
    # ... and the unclaimed one saw none (the field exists, so no AttributeError)
    assert none == [None, None]


@pytest.mark.slow
def test_task_code_in_a_prefork_child_sees_its_claim(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given a real prefork worker
    url, queue = private_redis.url, unique("q")
    lanes_worker(fleet, "a", broker=url, backend=url, queue=queue).wait_ready()
    client = fleet.client(url, url, queue)

    # When a task runs in a pool child
    assert client.send_task("lanes.work", (0,), task_id="child-1").get(timeout=30)

    # Then it logged the instance its claim was recorded done with
    start = next(e for e in events(url, queue) if e["event"] == "start")
    assert start["pid"] != fleet.procs[0].popen.pid
    done = wait_done(fleet.claims(url), queue, "child-1:0:0")
    assert start["instance"] == done.instance > 0


def test_a_retried_task_does_not_carry_its_claim_into_the_next_attempt(
    app: Celery, queue: str, claims: RedisClaimManager
) -> None:
    # Given a task that retries once and reports its claim on each attempt
    attempts: list[TaskClaim] = []
    task_id = unique("retry")

    @app.task(bind=True, shared=False, name="t.retry_once", max_retries=1)
    def retry_once(self: Any) -> int:
        attempts.append(self.request.claim)
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return self.request.claim.instance

    # When it runs
    with in_process_worker(app):
        result = retry_once.apply_async(task_id=task_id).get(timeout=20)

    # Then each attempt ran under its own claim (a fresh, larger instance)
    assert [a.task_id for a in attempts] == [f"{task_id}:0:0", f"{task_id}:1:0"]
    first_done = wait_done(claims, queue, f"{task_id}:0:0")
    assert attempts[1].instance > attempts[0].instance == first_done.instance
    assert result == attempts[1].instance


@on_every_server
def test_claim_acquired_names_the_previous_owner_on_a_takeover(
    app: Celery, queue: str, claims: RedisClaimManager
) -> None:
    # Given an expired claim of another owner on the task
    seen: list[dict[str, Any]] = []

    def on_acquired(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    task_id = unique("taken")
    claims.claim(queue, f"{task_id}:0:0", "dead/1/x", 1)
    claim_acquired.connect(on_acquired, weak=False)
    try:
        # When a worker gets the task
        with in_process_worker(app):
            app.tasks["t.whoami"].apply_async(task_id=task_id).get(timeout=20)
    finally:
        claim_acquired.disconnect(on_acquired)

    # Then the signal says it took over, and from whom
    assert [(s["took_over"], s["previous_owner"]) for s in seen] == [(True, "dead/1/x")]


def test_install_connects_the_journal() -> None:
    # Given an app with celery-claims installed, Then the journal receivers are connected
    app = Celery(unique("journal"), broker="redis://127.0.0.1:1/0", set_as_current=False)
    from celery_claims.worker import install

    install(app)
    assert history_connected()


# --- the startup safety check ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ({"task_acks_late": False, "task_time_limit": 60}, {"task_acks_late"}),
        (
            {
                "task_time_limit": 60,
                "worker_prefetch_multiplier": 4,
                "broker_transport_options": {"visibility_timeout": 0.5},
                "worker_cancel_long_running_tasks_on_connection_loss": True,
            },
            {
                "worker_prefetch_multiplier",
                "claims_renew_interval_ms",
                "worker_cancel_long_running_tasks_on_connection_loss",
            },
        ),
        (
            {"task_time_limit": 10, "task_soft_time_limit": 20, "claims_refresh_unacked": False},
            {"task_soft_time_limit", "claims_refresh_unacked"},
        ),
        ({}, {"task_time_limit"}),
    ],
    ids=["acks-late-off", "prefetch-visibility-cancel", "limits-refresh", "no-time-limit"],
)
def test_a_worker_warns_at_start_about_each_unsafe_setting_with_its_fix(
    conf: dict[str, Any],
    expected: set[str],
    redis_server: RedisServer,
    key_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a configuration with some unsafe settings
    # (the result backend is the broker's server here: retrying it keeps that advice out)
    conf = {"result_backend_always_retry": True, **conf}
    app = make_app(redis_server.url, queue=unique("q"), claims_prefix=key_prefix, **conf)
    try:
        # When a worker starts
        with (
            caplog.at_level(logging.WARNING, logger="celery_claims.worker"),
            in_process_worker(app) as worker,
        ):
            assert worker.claims is not None  # not strict: it runs
    finally:
        close_app(app)

    # Then each finding was logged once, saying the fix, and nothing else was
    warned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Unsafe setting")]
    assert sorted(m.split()[2] for m in warned) == sorted(expected), warned
    assert all(" Set " in m or " Leave " in m for m in warned), warned


@pytest.mark.slow
def test_claims_strict_settings_makes_the_celery_worker_command_refuse_to_start() -> None:
    # Given the real `celery worker` command, an unsafe setting (acks_late off) and strict mode
    env = {
        **os.environ,
        "CLAIMS_TEST_BROKER": "redis://127.0.0.1:1/0",
        "CLAIMS_TEST_BACKEND": "redis://127.0.0.1:1/0",
        "CLAIMS_TEST_QUEUE": unique("q"),
        "CLAIMS_TEST_UNSAFE": "1",
        "CLAIMS_TEST_STRICT": "1",
    }
    args = ["-A", "tests.worker.apps.lanes_app", "worker", "-P", "solo"]

    # When it starts
    done = subprocess.run(
        [sys.executable, "-m", "celery", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    # Then it exits non-zero, naming the strict setting and the unsafe one with its fix
    out = done.stderr + done.stdout
    assert done.returncode != 0
    # one line naming the setting (SettingRefused), not a traceback
    assert "Error: claims_strict_settings:" in out
    assert "Traceback" not in out
    assert "task_acks_late is off" in out
    assert "Set task_acks_late = True" in out


@on_every_server
def test_a_retry_of_a_copy_its_pool_process_settles_carries_none_of_the_settle_fields(
    store_server: RedisServer, queue: str, key_prefix: str, claims: RedisClaimManager
) -> None:
    # Given a task after whose body nothing can fail (no result stored), on a worker whose
    # claim store is its Redis broker: the process running its body settles it itself, told
    # how in its request (SETTLE_KEY)
    app = make_app(store_server.url, queue=queue, claims_prefix=key_prefix)
    settles: list[Any] = []

    @app.task(bind=True, shared=False, name="t.retry_quiet", ignore_result=True)
    def retry_quiet(self: Any) -> None:
        settles.append(getattr(self.request, SETTLE_KEY, None))
        if self.request.retries == 0:
            raise self.retry(countdown=0, max_retries=1)

    published: list[dict[str, Any]] = []

    def on_publish(headers: Any = None, **_: Any) -> None:
        published.append(dict(headers or {}))

    before_task_publish.connect(on_publish, weak=False)
    task_id = unique("settled-retry")
    try:
        with in_process_worker(app):
            # When its first attempt retries
            retry_quiet.apply_async(task_id=task_id)
            wait_done(claims, queue, f"{task_id}:1:0")
    finally:
        before_task_publish.disconnect(on_publish)
        close_app(app)

    # Then both attempts were settled by their pool process, and the message of the retry
    # carries nothing of the first delivery's settle (its delivery tag, kombu's keys)
    assert len(settles) == 2
    assert all(settle is not None for settle in settles)
    retried = [h for h in published if h.get("id") == task_id and h.get("retries") == 1]
    assert len(retried) == 1
    assert SETTLE_KEY not in retried[0]
