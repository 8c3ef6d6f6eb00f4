"""The demo fleet's Celery app, configured from the environment by the demo runner.

``CLAIMS_DEMO_REDIS`` (broker and claim store URL), ``CLAIMS_DEMO_NS`` (the namespace every
key of the demo starts with, so it can be removed from a shared Redis), ``CLAIMS_DEMO_QUEUE``,
``CLAIMS_DEMO_CLAIMS`` (``"1"``: ``celery_claims.install(app)``; ``"0"``: plain Celery),
``CLAIMS_DEMO_LANE_LIMIT`` and, optionally, ``CLAIMS_DEMO_METRICS_PORT``.

The broker uses a 3 s ``visibility_timeout`` with kombu's restore sweep every second, so a
task running longer than 3 s is redelivered quickly, as it would be after an hour with the
defaults.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis
from celery import Celery

URL = os.environ.get("CLAIMS_DEMO_REDIS", "redis://127.0.0.1:6379/0")
NS = os.environ.get("CLAIMS_DEMO_NS", "claims-demo")
QUEUE = os.environ.get("CLAIMS_DEMO_QUEUE", "claims")
CLAIMS = os.environ.get("CLAIMS_DEMO_CLAIMS", "1") == "1"
LANE_LIMIT = int(os.environ.get("CLAIMS_DEMO_LANE_LIMIT", "2"))
METRICS_PORT = os.environ.get("CLAIMS_DEMO_METRICS_PORT", "")

#: Seconds after which Redis restores an unacked message (kombu's default is 3600).
VISIBILITY_TIMEOUT_S = 3
#: Seconds one lane job runs.
LANE_JOB_S = 1.0

app = Celery("claims_demo", broker=URL)
app.conf.update(
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT_S,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # every broker key starts with the namespace, so a shared Redis can be cleaned
        "global_keyprefix": f"{NS}:",
    },
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_ignore_result=True,
    task_time_limit=60,
    worker_prefetch_multiplier=1,
    worker_enable_remote_control=False,
    worker_cancel_long_running_tasks_on_connection_loss=False,
    worker_hijack_root_logger=False,
    claims_prefix=NS,
    claims_lease_ms=3000,
    claims_renew_interval_ms=500,
    claims_held_recheck_ms=300,
    claims_socket_timeout_ms=2000,
)

if CLAIMS:
    from celery_claims.worker import install

    # the demo lane: lane jobs of this queue, capped fleet-wide; the plain side has no cap
    app.conf.claims_lanes = {
        "video": {"queues": [QUEUE], "kinds": ["demo.lane_job"], "limit": LANE_LIMIT}
    }
    install(app)  # also connects the journal of skipped copies
    if METRICS_PORT:
        from celery_claims.metrics import install_metrics

        # a port, or a range "first-last" from which each worker takes the first free port
        app.conf.claims_metrics_port = METRICS_PORT
        install_metrics(app)

_log: redis.Redis | None = None


def log_key(ns: str = NS) -> str:
    """The list every execution event of the demo is appended to."""
    return f"{ns}:log"


def record(event: str, task_id: str, task: Any, **extra: Any) -> None:
    """Append an execution event (who ran what, when) to the demo's log in Redis."""
    global _log
    if _log is None:
        _log = redis.Redis.from_url(URL)
    entry = {
        "event": event,
        "id": task_id,
        "side": "claims" if CLAIMS else "plain",
        "worker": task.request.hostname,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "at": time.time(),
        **extra,
    }
    _log.rpush(log_key(), json.dumps(entry))


@app.task(bind=True, name="demo.work")  # type: ignore[untyped-decorator]
def work(self: Any, seconds: float) -> float:
    """Sleep ``seconds`` (the "work"), logging its start and end."""
    record("start", self.request.id, self)
    time.sleep(seconds)
    record("end", self.request.id, self)
    return seconds


@app.task(bind=True, name="demo.lane_job")  # type: ignore[untyped-decorator]
def lane_job(self: Any, job: int) -> None:
    """One lane job: without claims the fleet's 4 pool slots are its only limit; with claims
    the ``video`` lane (``claims_lanes``) lets at most ``CLAIMS_DEMO_LANE_LIMIT`` run at once."""
    record("lane-start", f"job-{job}", self)
    time.sleep(LANE_JOB_S)
    record("lane-end", f"job-{job}", self)
