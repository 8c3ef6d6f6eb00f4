"""The app of the fleet-wide rate tests' real ``celery worker`` subprocesses.

Configured from the environment: ``CLAIMS_TEST_BROKER``, ``CLAIMS_TEST_BACKEND`` (Redis: the
result backend, the claim store and the start log), ``CLAIMS_TEST_QUEUE`` (the limited tasks'
queue; ``<queue>-other`` is a second queue), ``CLAIMS_TEST_RATE`` (the tasks' rate, default
``10/s``), ``CLAIMS_TEST_FLEETWIDE`` ("1": ``claims_rate_limit_fleetwide``),
``CLAIMS_TEST_BAD`` (an attribute to spoil: ``rate`` or ``key``), ``CLAIMS_TEST_LANES`` (JSON
of ``claims_lanes``), ``CLAIMS_TEST_METRICS_PORT`` (the worker's Prometheus exporter). Every
task logs its start to the Redis list ``starts:<queue>``; every ``task_held`` is logged there
too.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_claims.worker import install, task_held

BROKER = os.environ["CLAIMS_TEST_BROKER"]
BACKEND = os.environ["CLAIMS_TEST_BACKEND"]
QUEUE = os.environ["CLAIMS_TEST_QUEUE"]
OTHER = f"{QUEUE}-other"
RATE = os.environ.get("CLAIMS_TEST_RATE", "10/s")
BAD = os.environ.get("CLAIMS_TEST_BAD", "")

app = Celery("rates", broker=BROKER, backend=BACKEND)
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
    task_time_limit=60,
    result_expires=None,
    claims_redis_url=BACKEND,
    claims_rate_limit_fleetwide=os.environ.get("CLAIMS_TEST_FLEETWIDE") == "1",
    claims_lanes=json.loads(os.environ.get("CLAIMS_TEST_LANES", "{}")),
)
install(app)
if os.environ.get("CLAIMS_TEST_METRICS_PORT"):
    from celery_claims.metrics import install_metrics

    app.conf.claims_metrics_port = os.environ["CLAIMS_TEST_METRICS_PORT"]
    install_metrics(app)

_log: redis.Redis | None = None


def log(entry: dict[str, Any]) -> None:
    """Append an event to ``starts:<queue>`` (the backend Redis)."""
    global _log
    if _log is None:
        _log = redis.Redis.from_url(BACKEND)
    _log.rpush(f"starts:{QUEUE}", json.dumps(entry))


def _start(task: Any, **extra: Any) -> None:
    """Log a start: ``at`` is when the claim store let it start (its fleet-wide rate's count,
    by the store's clock) for a task the worker rated, else when it started here."""
    granted = task.request.get("claims_rate_at_ms")
    log(
        {
            "event": "start",
            "task": task.name,
            "id": task.request.id,
            "worker": task.request.hostname,
            "at": granted / 1000 if granted else time.time(),
            "logged": time.time(),
            **extra,
        }
    )


@app.task(bind=True, name="rates.tick", claims_rate="10/x" if BAD == "rate" else RATE)
def tick(self: Any) -> None:
    """A short task under ``claims_rate``."""
    _start(self)
    time.sleep(0.02)


@app.task(bind=True, name="rates.celery_tick", rate_limit=RATE)
def celery_tick(self: Any) -> None:
    """A short task under Celery's own ``rate_limit`` (per worker, unless fleet-wide)."""
    _start(self)
    time.sleep(0.02)


@app.task(bind=True, name="rates.both", rate_limit="5/s", claims_rate="20/s")
def both(self: Any) -> None:
    """Celery's ``rate_limit`` and a looser ``claims_rate``: under
    ``claims_rate_limit_fleetwide`` the latter is the task's only rate."""
    _start(self)
    time.sleep(0.02)


@app.task(
    bind=True,
    name="rates.customer",
    claims_rate=RATE,
    claims_rate_key="nobody" if BAD == "key" else "customer",
)
def customer_task(self: Any, customer: Any) -> None:
    """A short task whose rate is per ``customer``."""
    _start(self, customer=customer)
    time.sleep(0.02)


@app.task(bind=True, name="rates.other")
def other(self: Any, customer: Any = None) -> None:
    """A task without a rate of its own (sent to the other queue; in a lane there)."""
    _start(self, customer=customer)


@task_held.connect
def _on_held(sender: Any = None, request: Any = None, reason: str = "", **kw: Any) -> None:
    log(
        {
            "event": "held",
            "reason": reason,
            "rate": kw.get("rate", ""),
            "id": getattr(request, "id", None),
            "at": time.time(),
        }
    )
