"""The app of the real ``celery worker`` subprocesses, configured from the environment.

``CLAIMS_TEST_BROKER`` (broker URL), ``CLAIMS_TEST_BACKEND`` (Redis result backend and the
execution log), ``CLAIMS_TEST_QUEUE`` (the test's queue), ``CLAIMS_TEST_PLUGIN`` ("0" runs the
same app without celery-claims). Claim settings come from ``--claims-*`` worker options.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any

import redis
from celery import Celery

from celery_claims.effects import apply_once_redis
from celery_claims.worker import current_claim, install

BROKER = os.environ["CLAIMS_TEST_BROKER"]
BACKEND = os.environ["CLAIMS_TEST_BACKEND"]
QUEUE = os.environ["CLAIMS_TEST_QUEUE"]

app = Celery("fleet", broker=BROKER, backend=BACKEND)
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
# more configuration, as JSON (``claims_redis_options``, ``broker_transport_options``, ...)
for key, value in json.loads(os.environ.get("CLAIMS_TEST_CONF", "{}")).items():
    if isinstance(value, dict) and isinstance(app.conf.get(key), dict):
        value = {**app.conf.get(key), **value}
    app.conf[key] = value
if os.environ.get("CLAIMS_TEST_PLUGIN", "1") == "1":
    install(app)

_log: redis.Redis | None = None


def executions_key(queue: str) -> str:
    """The Redis list every execution of a task of ``queue`` is logged to."""
    return f"executions:{queue}"


def record(event: str, task: Any) -> None:
    """Log an execution event durably (RPUSH to the backend Redis), with who ran it."""
    global _log
    if _log is None:
        _log = redis.Redis.from_url(BACKEND)
    entry = {
        "event": event,
        "id": task.request.id,
        "worker": task.request.hostname,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "at": time.time(),
    }
    _log.rpush(executions_key(QUEUE), json.dumps(entry))


@app.task(bind=True, name="fleet.sleep")
def sleep(self: Any, seconds: float) -> float:
    """Sleep ``seconds``, logging the start and the end."""
    record("start", self)
    time.sleep(seconds)
    record("end", self)
    return seconds


@app.task(bind=True, name="fleet.sleep_then_apply")
def sleep_then_apply(self: Any, seconds: float) -> float:
    """Sleep ``seconds``, then add 1 to ``effects:<queue>`` once per attempt
    (``effects.apply_once_redis``, the marker keyed by the attempt), logging start and end."""
    global _log
    record("start", self)
    time.sleep(seconds)
    if _log is None:
        _log = redis.Redis.from_url(BACKEND)
    claim = current_claim()
    marker = f"effect:{QUEUE}:{self.request.id}"
    apply_once_redis(
        _log, marker, [("INCRBY", f"effects:{QUEUE}", 1)],
        instance=claim.instance if claim is not None else 0,
    )  # fmt: skip
    record("end", self)
    return seconds


@app.task(bind=True, name="fleet.kill_child")
def kill_child(self: Any) -> None:
    """Kill the pool child running this task (the parent sees ``WorkerLostError``)."""
    record("start", self)
    os.kill(os.getpid(), signal.SIGKILL)


@app.task(bind=True, name="fleet.hard_limit", time_limit=1.5)
def hard_limit(self: Any) -> None:
    """Run past the hard time limit (the child is killed by the pool)."""
    record("start", self)
    time.sleep(30)


@app.task(bind=True, name="fleet.crash_worker")
def crash_worker(self: Any) -> None:
    """A poison task: kills its whole worker (main process and pool) every time it runs."""
    record("start", self)
    os.killpg(os.getpgid(0), signal.SIGKILL)


@app.task(bind=True, name="fleet.hang_once", time_limit=2)
def hang_once(self: Any) -> str:
    """Hang far past its 2 s time limit on its first run, return at once on later runs."""
    global _log
    record("start", self)
    assert _log is not None  # record() made it
    if _log.set(f"hung:{QUEUE}:{self.request.id}", "1", nx=True):
        time.sleep(60)
    record("end", self)
    return "done"
