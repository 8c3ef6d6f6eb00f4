"""Which time limit a request runs under, as Celery resolves it (``policy.time_limit_of``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from celery_claims.worker.policy import time_limit_of


def request(soft: Any = None, hard: Any = None) -> SimpleNamespace:
    return SimpleNamespace(time_limits=(soft, hard))


def task(soft: Any = None, hard: Any = None) -> SimpleNamespace:
    return SimpleNamespace(soft_time_limit=soft, time_limit=hard)


@pytest.mark.parametrize(
    ("req", "tsk", "worker", "expected"),
    [
        # the message's limit first, then the task's, then the worker's
        (request(hard=5), task(hard=7), (None, 9), 5.0),
        (request(), task(hard=7), (None, 9), 7.0),
        (request(), task(), (None, 9), 9.0),
        # the hard limit counts when there is one, else the soft limit
        (request(soft=3), task(), (None, 9), 9.0),
        (request(soft=3), task(), (None, None), 3.0),
        (request(), task(soft=4), (2, None), 4.0),
        (request(), task(), (2, None), 2.0),
        # no limit anywhere
        (request(), task(), (None, None), None),
        # what Celery would not run under either: ignored
        (request(hard=True), task(hard=-1), (None, "x"), None),
    ],
)
def test_the_limit_is_the_messages_else_the_tasks_else_the_workers_hard_before_soft(
    req: Any, tsk: Any, worker: tuple[Any, Any], expected: float | None
) -> None:
    assert time_limit_of(req, tsk, worker) == expected
