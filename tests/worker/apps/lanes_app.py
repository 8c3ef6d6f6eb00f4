"""The app of the lane and lease-loss tests' real ``celery worker`` subprocesses.

Configured from the environment: ``CLAIMS_TEST_BROKER``, ``CLAIMS_TEST_BACKEND`` (Redis: the
result backend, the claim store and the interval log), ``CLAIMS_TEST_QUEUE`` (the lane's queue;
``<queue>-other`` is a second queue outside the lane), ``CLAIMS_TEST_LANES`` (JSON of
``claims_lanes``), ``CLAIMS_TEST_PREFIX``, and optionally ``CLAIMS_TEST_PG`` (a PostgreSQL DSN
for the fenced write) and ``CLAIMS_TEST_STRICT`` ("1": ``claims_strict_settings``).
Every task logs its start and end to the Redis list ``intervals:<queue>`` with the fencing
number it ran under, and each worker logs its claim counters there too.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready

from celery_claims.worker import install, task_held

BROKER = os.environ["CLAIMS_TEST_BROKER"]
BACKEND = os.environ["CLAIMS_TEST_BACKEND"]
QUEUE = os.environ["CLAIMS_TEST_QUEUE"]
OTHER = f"{QUEUE}-other"

app = Celery("lanes", broker=BROKER, backend=BACKEND)
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": 3,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    task_default_queue=QUEUE,
    task_queues=None,
    task_acks_late=True,
    task_time_limit=120,
    worker_prefetch_multiplier=1,
    result_expires=None,
    claims_redis_url=BACKEND,
    claims_prefix=os.environ.get("CLAIMS_TEST_PREFIX", "claims"),
    claims_lanes=json.loads(os.environ.get("CLAIMS_TEST_LANES", "{}")),
    claims_strict_settings=os.environ.get("CLAIMS_TEST_STRICT") == "1",
)
if os.environ.get("CLAIMS_TEST_UNSAFE") == "1":
    app.conf.task_acks_late = False
install(app)

_log: redis.Redis | None = None


def log(entry: dict[str, Any]) -> None:
    """Append an event to ``intervals:<queue>`` (the backend Redis)."""
    global _log
    if _log is None:
        _log = redis.Redis.from_url(BACKEND)
    _log.rpush(f"intervals:{QUEUE}", json.dumps(entry))


def _event(event: str, task: Any, **extra: Any) -> None:
    claim = getattr(task.request, "claim", None)
    log(
        {
            "event": event,
            "id": task.request.id,
            "worker": task.request.hostname,
            "pid": os.getpid(),
            "instance": getattr(claim, "instance", None),
            "at": time.time(),
            **extra,
        }
    )


@app.task(bind=True, name="lanes.work")
def work(self: Any, seconds: float) -> str:
    """Sleep ``seconds`` between a logged start and end; return who ran it."""
    _event("start", self)
    time.sleep(seconds)
    _event("end", self)
    return f"{self.request.hostname}/{os.getpid()}"


@app.task(bind=True, name="lanes.export")
def export(self: Any, tenant_id: Any, seconds: float) -> str:
    """A keyed lane's task: like ``lanes.work``, its log entries name ``tenant_id``."""
    _event("start", self, tenant=tenant_id)
    time.sleep(seconds)
    _event("end", self, tenant=tenant_id)
    return f"{self.request.hostname}/{os.getpid()}"


@app.task(bind=True, name="lanes.fenced_write")
def fenced_write(self: Any, row: int, seconds: float) -> str:
    """Sleep, then write this copy's name to PostgreSQL guarded by the claim's instance."""
    from sqlalchemy import create_engine

    from celery_claims.fencing import fenced_upsert

    _event("start", self)
    time.sleep(seconds)
    claim = self.request.claim
    engine = create_engine(os.environ["CLAIMS_TEST_PG"])
    try:
        with engine.begin() as conn:
            written = fenced_upsert(
                conn,
                _table(),
                {"id": row},
                {"writer": f"{self.request.hostname}/{os.getpid()}"},
                claim.instance,
            )
    finally:
        engine.dispose()
    _event("written" if written else "refused", self)
    return self.request.hostname


def _table() -> Any:
    from sqlalchemy import BigInteger, Column, Integer, MetaData, Table, Text

    return Table(
        os.environ.get("CLAIMS_TEST_PG_TABLE", "fenced_rows"),
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("writer", Text, nullable=False),
        Column("fence", BigInteger, nullable=False),
    )


@task_held.connect
def _on_held(sender: Any = None, request: Any = None, reason: str = "", **_: Any) -> None:
    log(
        {
            "event": "held",
            "reason": reason,
            "id": getattr(request, "id", None),
            "worker": getattr(request, "hostname", None),
            "at": time.time(),
        }
    )


@worker_ready.connect
def _on_ready(sender: Any = None, **_: Any) -> None:
    # publish this worker's counters every 0.1 s, so the test can read them after a kill
    import threading

    runtime = sender.controller.claims
    client = redis.Redis.from_url(BACKEND)
    key = f"counters:{QUEUE}:{sender.hostname}"

    def publish() -> None:
        while True:
            client.set(key, json.dumps(runtime.counters.snapshot()))
            time.sleep(0.1)

    threading.Thread(target=publish, daemon=True, name="test-counters").start()


@app.task(bind=True, name="lanes.fail")
def fail(self: Any) -> None:
    """Fail at once (its claim is released; Celery stores the error)."""
    _event("start", self)
    raise ValueError("boom")
