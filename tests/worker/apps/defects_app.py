"""The app of the defect tests' real ``celery worker`` subprocesses, configured from the env.

Like :mod:`tests.worker.apps.fleet`, plus ``CLAIMS_TEST_LOG``: the Redis the execution log is
written to (default: ``CLAIMS_TEST_BACKEND``), so a test can stop the broker and the result
backend and still read who ran what. Every event carries the claim instance it ran under.
Claim settings come from ``--claims-*`` worker options.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import redis
from celery import Celery

from celery_claims.worker import install

BROKER = os.environ["CLAIMS_TEST_BROKER"]
BACKEND = os.environ["CLAIMS_TEST_BACKEND"]
QUEUE = os.environ["CLAIMS_TEST_QUEUE"]
LOG = os.environ.get("CLAIMS_TEST_LOG", BACKEND)

app = Celery("defects", broker=BROKER, backend=BACKEND)
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


def record(event: str, task: Any) -> None:
    """Log an execution event durably (RPUSH to ``executions:<queue>`` on ``LOG``)."""
    global _log
    if _log is None:
        _log = redis.Redis.from_url(LOG)
    claim = getattr(task.request, "claim", None)
    entry = {
        "event": event,
        "id": task.request.id,
        "worker": task.request.hostname,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "instance": getattr(claim, "instance", None),
        "at": time.time(),
    }
    _log.rpush(f"executions:{QUEUE}", json.dumps(entry))


@app.task(bind=True, name="defects.sleep")
def sleep(self: Any, seconds: float) -> float:
    """Sleep ``seconds``, logging the start and the end."""
    record("start", self)
    time.sleep(seconds)
    record("end", self)
    return seconds
