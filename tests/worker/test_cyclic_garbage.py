"""A message leaves no more cyclic garbage in the worker than plain Celery leaves (issue 33).

Each request and its copy are freed by reference counting, as plain Celery's request is:
nothing on a request refers back to it (its pool reports go through a subclass, not closures
over its own methods), its hooks let go of the copy after the pool's last report, and the
request does not point at its copy. Cyclic garbage costs the worker's main thread a
collection every few hundred objects, each traversing every young object.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.signals import task_received

from celery_claims.testing import close_app, in_process_worker
from tests.servers import RedisServer
from tests.worker.helpers import make_app, unique

#: Messages a batch (after a warm-up batch, so that the worker's one-off objects are made).
MESSAGES = 40

#: How long the requests of a batch may take to be freed once their tasks ran (their
#: completion record and ack come after the body).
FREED_WITHIN_S = 10


@pytest.fixture
def gc_on_again() -> Iterator[None]:
    """The test turns the collector off around its batches: it is on again after it."""
    try:
        yield
    finally:
        gc.enable()


def _app(store_server: RedisServer, key_prefix: str, *, plugin: bool) -> tuple[Celery, Any]:
    """An app of one no-op task, and ``batch()``, which sends ``MESSAGES`` of it and waits
    until the worker ran them all."""
    app = make_app(
        store_server.url,
        queue=unique("q"),
        claims_prefix=key_prefix,
        plugin=plugin,
        task_ignore_result=True,
    )
    counter: list[None] = []
    ran = threading.Condition()

    @app.task(shared=False, name="t.count")
    def count() -> None:
        with ran:
            counter.append(None)
            ran.notify_all()

    def batch() -> None:
        start = len(counter)
        for _ in range(MESSAGES):
            count.apply_async()
        with ran:
            assert ran.wait_for(lambda: len(counter) >= start + MESSAGES, timeout=30)

    return app, batch


def _requests_left_to_the_collector(app: Celery, batch: Any, pool: str) -> int:
    """How many requests of a batch run with the collector off are still alive once every
    message of it has had time to end: only the cyclic collector would free them."""
    requests: list[weakref.ref[Any]] = []

    def received(request: Any = None, **_: Any) -> None:
        requests.append(weakref.ref(request))

    with in_process_worker(app, pool=pool, concurrency=2 if pool == "threads" else 1):
        batch()  # a warm-up
        gc.collect()
        gc.disable()
        task_received.connect(received, weak=False)
        try:
            batch()
            deadline = time.monotonic() + FREED_WITHIN_S
            while any(r() is not None for r in requests) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = sum(r() is not None for r in requests)
        finally:
            task_received.disconnect(received)
            gc.enable()
    assert len(requests) == MESSAGES
    return left


@pytest.mark.parametrize("pool", ["solo", "threads"])
def test_a_claimed_message_leaves_its_request_to_reference_counting_as_plain_celery_does(
    pool: str, store_server: RedisServer, key_prefix: str, gc_on_again: None
) -> None:
    # Given plain Celery's worker and a worker with celery-claims, of the same pool
    plain, plain_batch = _app(store_server, key_prefix, plugin=False)
    claims, claims_batch = _app(store_server, key_prefix, plugin=True)
    try:
        # When each runs a batch of tasks with the cyclic garbage collector off
        plain_left = _requests_left_to_the_collector(plain, plain_batch, pool)
        claims_left = _requests_left_to_the_collector(claims, claims_batch, pool)
    finally:
        close_app(plain)
        close_app(claims)

    # Then every request is freed without the collector, in plain Celery (the reference)
    # and with claims (main left every one: the request, its message, its promises, its copy
    # and the hooks' closures, in one cycle per message, about 53 objects)
    assert (plain_left, claims_left) == (0, 0)
