"""The app of the defect tests' real ``celery worker`` subprocesses: the fleet app
(:mod:`tests.worker.apps.fleet`, configured from the same environment) plus a task that logs
to ``CLAIMS_TEST_LOG`` (default: ``CLAIMS_TEST_BACKEND``), so a test can stop the broker and
the result backend and still read who ran what. Every event carries the claim instance.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from typing import Any

import redis

from tests.worker.apps.fleet import BACKEND, QUEUE, app

__all__ = ["app"]

LOG = os.environ.get("CLAIMS_TEST_LOG", BACKEND)

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


@app.task(bind=True, name="defects.fail")
def fail(self: Any) -> None:
    """Log the start, then fail (Celery acks a failed ``acks_late`` task: it is over)."""
    record("start", self)
    raise ValueError("this task always fails")


@app.task(bind=True, name="defects.until")
def until(self: Any, key: str, timeout_s: float = 60.0) -> str:
    """Run until the test sets ``key`` on ``LOG`` (a cross-process release), then return."""
    record("start", self)
    assert _log is not None
    deadline = time.monotonic() + timeout_s
    while not _log.exists(key):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key} was never set")
        time.sleep(0.02)
    record("end", self)
    return "done"


@app.task(bind=True, name="defects.pause_parent", ignore_result=True)
def pause_parent(self: Any) -> None:
    """Stop the worker's main process (SIGSTOP, as a long GC pause or a frozen VM would), then
    return: the body is over, the main process has not seen it end. Only the first run of a
    task id stops its worker, so a second run shows up as what it is."""
    record("start", self)
    assert _log is not None
    if _log.set(f"paused:{self.request.id}", 1, nx=True):
        os.kill(os.getppid(), signal.SIGSTOP)
    record("end", self)


@app.task(name="defects.quiet", ignore_result=True)
def quiet(i: int) -> int:
    """Nothing after its body can fail (no result stored, no callback): the process that runs
    it settles its copy itself where the claim store is the broker's server."""
    return i
