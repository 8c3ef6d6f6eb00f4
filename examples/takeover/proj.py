"""A Celery app whose long task survives the crash of the worker running it.

Configured from ``TAKEOVER_BROKER`` so the runner can point it at a private Redis. The
timings are shortened so the whole story fits in a few seconds; in production keep the
defaults (a 60 s lease) and a ``visibility_timeout`` a few times the lease.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from celery_claims.worker import install

BROKER = os.environ.get("TAKEOVER_BROKER", "redis://localhost:6379/0")
#: The list every execution of ``build_report`` is logged to (start and end).
RUNS_KEY = "takeover:runs"

app = Celery("takeover", broker=BROKER, backend=BROKER)
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": 3,  # Redis restores a dead worker's unacked message after 3 s
        # kombu sweeps every ~100 s without these two (read by kombu from 5.7, and by
        # celery-claims' worker on kombu 5.3 to 5.6)
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    task_default_queue="reports",
    task_acks_late=True,  # takeover needs the message unacked while the task runs
    worker_prefetch_multiplier=1,
    task_time_limit=60,
    result_expires=None,
    worker_cancel_long_running_tasks_on_connection_loss=False,
    claims_lease_ms=3000,  # a crashed worker's claim expires 3 s after its last renewal
    claims_renew_interval_ms=500,
    claims_held_recheck_ms=300,
)
install(app)  # the one line


@app.task(bind=True, name="takeover.build_report")  # type: ignore[untyped-decorator]
def build_report(self: Any, seconds: float) -> str:
    """Work for ``seconds``, logging who started and who finished it."""
    log("start", self)
    time.sleep(seconds)
    log("end", self)
    return f"{self.request.id} built by {self.request.hostname}"


def log(event: str, task: Any) -> None:
    """Append an execution event to ``RUNS_KEY`` so the runner can count executions."""
    entry = {"event": event, "worker": task.request.hostname, "pid": os.getpid()}
    with redis.Redis.from_url(BROKER) as client:
        client.rpush(RUNS_KEY, json.dumps(entry))
