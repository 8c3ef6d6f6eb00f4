"""Canvas tasks for real ``celery worker`` subprocesses, and a crash at a chosen point of
Celery's trace after a body returned (``tests/worker/test_canvas_crash.py``).

The fleet app (``apps/fleet.py``: its environment, settings and ``install(app)``) with these
tasks, its results stored through :class:`CrashingBackend`. ``CLAIMS_TEST_CRASH`` names where
the worker (main process and pool, one process group) is SIGKILLed, once per test (a marker
key in the backend Redis):

- ``publish:<task name>``: when a running task, its body returned, is about to publish a
  message of that task (a chain's next step, a callback), before it reaches the broker;
- ``done:<task name>``: when Celery's trace, the body of that task returned and its next
  steps sent, is about to store its result and report a chord's part (the backend's
  ``mark_as_done``);
- ``success:<task name>``: at ``task_success`` of that task, in the process that ran it:
  its result stored, a chord's part reported, but the trace not ended.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import redis
from celery import current_task
from celery.backends.redis import RedisBackend
from celery.signals import before_task_publish, task_success

from tests.worker.apps.fleet import BACKEND, QUEUE, app, executions_key

__all__ = ["app"]

CRASH = os.environ.get("CLAIMS_TEST_CRASH", "")


class CrashingBackend(RedisBackend):  # type: ignore[misc]  # celery is untyped
    """Celery's Redis result backend, with the ``done:`` crash point."""

    def mark_as_done(
        self, task_id: str, result: Any, request: Any = None, *a: Any, **kw: Any
    ) -> Any:
        _crash_once(f"done:{getattr(request, 'task', '')}")
        return super().mark_as_done(task_id, result, request, *a, **kw)


# the fleet app (its settings, install(app)), its results through the crashing backend
app.conf.result_backend = f"{__name__}:CrashingBackend+{BACKEND}"

_log: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _log
    if _log is None:
        _log = redis.Redis.from_url(BACKEND)
    return _log


def _record(event: str, task: Any) -> None:
    entry = {"event": event, "id": task.request.id, "name": task.name, "at": time.time()}
    entry["worker"] = task.request.hostname
    _redis().rpush(executions_key(QUEUE), json.dumps(entry))


def _crash_once(point: str) -> None:
    """SIGKILL this worker's whole process group the first time ``point`` is reached."""
    if point != CRASH or not _redis().set(f"crashed:{QUEUE}", point, nx=True):
        return
    os.killpg(os.getpgid(0), signal.SIGKILL)


@task_success.connect
def _on_success(sender: Any = None, **_: Any) -> None:
    _crash_once(f"success:{getattr(sender, 'name', '')}")


@before_task_publish.connect
def _on_publish(sender: Any = None, **_: Any) -> None:
    if current_task is not None and current_task.request.id is not None:
        _crash_once(f"publish:{sender}")


@app.task(bind=True, name="canvas.part")
def part(self: Any, value: int) -> int:
    """A chord's header part: returns ``value``."""
    _record("end", self)
    return value


@app.task(bind=True, name="canvas.total")
def total(self: Any, values: list[int]) -> int:
    """A chord's body: the sum of its parts."""
    _record("end", self)
    return sum(values)


@app.task(bind=True, name="canvas.slow_step")
def slow_step(self: Any, value: int, seconds: float) -> int:
    """A chain's step that runs ``seconds``: ``value + 1``."""
    _record("start", self)
    time.sleep(seconds)
    _record("end", self)
    return value + 1


@app.task(bind=True, name="canvas.step")
def step(self: Any, value: int) -> int:
    """A chain's step: ``value + 1``."""
    _record("end", self)
    return value + 1
