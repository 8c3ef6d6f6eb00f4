"""Helpers shared by the worker tests: polling with deadlines, app factories, recorders."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from celery import Celery

# the testing kit's own, re-exported for the suite
from celery_claims.testing import close_app as close_app
from celery_claims.testing import in_process_worker as in_process_worker
from celery_claims.worker import install

T = TypeVar("T")

#: Broker options that make Redis redeliver an unacked message after 3 s (kombu 5.7 needs the
#: restore interval and throttle too, or it only sweeps every ~100 s).
FAST_REDELIVERY = {
    "visibility_timeout": 3,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
}

#: The machine's RabbitMQ.
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"

#: Short leases so takeovers happen within seconds.
LEASE_MS = 3000
RENEW_INTERVAL_MS = 500
HELD_RECHECK_MS = 300
#: Journal settings of the worker subprocess tests: recovery acts 5 s after a publish (above
#: the fleet's 3 s lease and visibility timeout) and workers look every half second.
FAST_JOURNAL = {"claims_journal_recover_after_ms": 5000, "claims_journal_scan_interval_ms": 500}


def wait_for(
    check: Callable[[], T], *, timeout: float, interval: float = 0.05, what: str = "condition"
) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def wait_done(claims: Any, queue: str, task_key: str, timeout: float = 10) -> Any:
    """The completion record of ``task_key``, waiting for it.

    A result is stored by the task's trace before the worker records completion, so a test
    that has the result may look a moment too early.
    """
    return wait_for(
        lambda: claims.done_record(queue, task_key), timeout=timeout, what=f"done {task_key}"
    )


def unique(prefix: str) -> str:
    """A name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def make_app(
    broker_url: str,
    *,
    queue: str,
    claims_prefix: str,
    plugin: bool = True,
    **conf: Any,
) -> Celery:
    """An app on a private broker with fast redelivery and short leases."""
    app = Celery(unique("claims-test"), broker=broker_url, backend=broker_url, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        broker_transport_options=dict(FAST_REDELIVERY),
        result_backend_transport_options=dict(FAST_REDELIVERY),
        task_default_queue=queue,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        # redis-py 8 deprecates SETEX, which Celery's result backend uses for expiring results
        result_expires=None,
        claims_prefix=claims_prefix,
        claims_lease_ms=LEASE_MS,
        claims_renew_interval_ms=RENEW_INTERVAL_MS,
        claims_held_recheck_ms=HELD_RECHECK_MS,
        claims_unavailable_retry_ms=200,
        claims_unavailable_retry_max_ms=1000,
        claims_socket_timeout_ms=1000,
    )
    app.conf.update(conf)
    if plugin:
        install(app)
    return app


class Paused:
    """What a task made by :func:`paused_task` shares with the test: ``started`` is set when
    its body starts, it returns only once the test sets ``release``; ``runs`` lists the ids
    of its runs."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.runs: list[str] = []


def paused_task(app: Celery, name: str, timeout_s: float = 30) -> tuple[Any, Paused]:
    """A task of ``app`` (for an in-process worker) that returns ``"done"`` when released."""
    paused = Paused()

    @app.task(shared=False, name=name, bind=True)
    def body(self: Any) -> str:
        paused.runs.append(self.request.id)
        paused.started.set()
        paused.release.wait(timeout_s)
        return "done"

    return body, paused
