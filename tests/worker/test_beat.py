"""A real ``celery beat`` sends ``celery_claims.cleanup_expired`` on its own schedule."""

from __future__ import annotations

import json

import pytest

from tests.servers import RedisServer
from tests.worker.helpers import unique, wait_for
from tests.worker.processes import Fleet

pytestmark = pytest.mark.slow


def test_beat_sends_the_cleanup_task_even_when_the_user_assigns_beat_schedule_after_install(
    fleet: Fleet, private_redis: RedisServer
) -> None:
    # Given an app that calls install(app) and then assigns app.conf.beat_schedule
    # (tests/worker/apps/beat_app.py), with a 1 s cleanup interval
    queue = unique("q")
    fleet.beat("beat", broker=private_redis.url, queue=queue)
    client = fleet.redis(private_redis.url)

    def sent() -> set[str]:
        return {json.loads(raw)["headers"]["task"] for raw in client.lrange(queue, 0, -1)}

    # When beat runs, Then it sends both the cleanup task and the user's own entry
    try:
        wait_for(
            lambda: {"celery_claims.cleanup_expired", "user.report"} <= sent(),
            timeout=20,
            interval=0.2,
            what="both entries to be sent",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; sent {sorted(sent())}\n{fleet.logs()}") from None
