"""Keyed tasks for real ``celery worker`` subprocesses (configured like ``apps/fleet.py``).

Every run records ``{"id", "key", "event", "at", "worker"}`` entries (``start``, ``end``) in
the Redis list ``runs:<queue>`` on the backend Redis, so a test can rebuild each run's interval.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_claims.worker import install

BROKER = os.environ["CLAIMS_TEST_BROKER"]
BACKEND = os.environ["CLAIMS_TEST_BACKEND"]
QUEUE = os.environ["CLAIMS_TEST_QUEUE"]

app = Celery("keyed", broker=BROKER, backend=BACKEND)
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": 3,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    task_default_queue=QUEUE,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    result_expires=None,
)
install(app)

_log: redis.Redis | None = None


def runs_key(queue: str) -> str:
    """The Redis list the runs of ``queue``'s tasks are recorded in."""
    return f"runs:{queue}"


def record(event: str, task: Any, key: object) -> None:
    global _log
    if _log is None:
        _log = redis.Redis.from_url(BACKEND)
    entry = {
        "event": event,
        "id": task.request.id,
        "key": key,
        "worker": task.request.hostname,
        "at": time.time(),
        "instance": getattr(getattr(task.request, "claim", None), "instance", 0),
    }
    _log.rpush(runs_key(QUEUE), json.dumps(entry))


def _run(task: Any, key: object, seconds: float) -> str:
    record("start", task, key)
    time.sleep(seconds)
    record("end", task, key)
    return task.request.id


@app.task(bind=True, name="keyed.sync", claims_key="customer_id")
def sync(self: Any, customer_id: str, seconds: float = 0.2) -> str:
    """One sync per customer at a time (``wait``)."""
    return _run(self, customer_id, seconds)


@app.task(bind=True, name="keyed.skip", claims_key="customer_id", claims_key_conflict="skip")
def skip(self: Any, customer_id: str, seconds: float = 0.2) -> str:
    """A second message for a held customer is skipped."""
    return _run(self, customer_id, seconds)


@app.task(
    bind=True,
    name="keyed.resched",
    claims_key="customer_id",
    claims_key_conflict="reschedule",
    claims_key_reschedule_s=1,
    claims_key_reschedule_max=2,
)
def resched(self: Any, customer_id: str, seconds: float = 0.2) -> str:
    """A second message for a held customer is published again (twice), then waits."""
    return _run(self, customer_id, seconds)


@app.task(bind=True, name="keyed.pay", claims_key="payment_id", claims_key_done_ttl=60)
def pay(self: Any, payment_id: str, seconds: float = 0.2) -> str:
    """A payment id done in the last minute is skipped, whatever the task id."""
    return _run(self, payment_id, seconds)


@app.task(bind=True, name="keyed.export", claims_key=("tenant", "kind"))
def export(self: Any, tenant: Any, kind: str = "csv", seconds: float = 0.2) -> str:
    """Keyed on two arguments (a tenant may be any JSON value: bad ones are refused)."""
    return _run(self, [tenant, kind], seconds)


if os.environ.get("CLAIMS_TEST_BAD_KEY") == "1":

    @app.task(bind=True, name="keyed.bad", claims_key="nope")
    def bad(self: Any, customer_id: str) -> None:
        """Keyed on an argument it does not take: the worker refuses to start."""
