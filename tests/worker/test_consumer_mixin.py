"""The consumer mixin: a fleet's own consumer class (``worker_consumer``) carries the gate."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_claims import RedisClaimManager
from celery_claims.errors import InvalidArgument
from celery_claims.worker import ClaimsConsumerMixin, signals
from celery_claims.worker.delivery.gate import ClaimGate
from celery_claims.worker.steps import Gate
from tests.servers import RedisServer
from tests.worker.apps import custom_consumer
from tests.worker.helpers import close_app, in_process_worker, make_app, wait_done, wait_for

CONSUMER = "tests.worker.apps.custom_consumer:FleetConsumer"


@pytest.fixture
def app(redis_server: RedisServer, queue: str, key_prefix: str) -> Iterator[Celery]:
    app = make_app(
        redis_server.url, queue=queue, claims_prefix=key_prefix, worker_consumer=CONSUMER
    )
    try:
        yield app
    finally:
        close_app(app)


def test_a_custom_consumer_with_the_mixin_runs_a_duplicated_task_once(
    app: Celery, claims: RedisClaimManager, queue: str
) -> None:
    # Given a worker whose consumer is the fleet's own class, claims mixed in
    runs: list[str] = []

    @app.task(shared=False, name="mixin.echo")
    def echo(value: str) -> str:
        runs.append(value)
        return value

    skipped: list[str] = []

    def on_skipped(sender: Any = None, request: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is app:
            skipped.append(request.id)

    signals.task_skipped.connect(on_skipped, weak=False)
    try:
        with in_process_worker(app) as worker:
            consumer = worker.consumer
            # When two copies of one task arrive
            task_id = str(uuid.uuid4())
            first = echo.apply_async(("once",), task_id=task_id)
            assert first.get(timeout=10) == "once"
            wait_done(claims, queue, f"{task_id}:0:0")
            echo.apply_async(("once",), task_id=task_id)
            wait_for(lambda: skipped, timeout=10, what="the duplicate to be skipped")
    finally:
        signals.task_skipped.disconnect(on_skipped)

    # Then the fleet's consumer saw both, the gate ran the task once and skipped the copy
    assert type(consumer) is custom_consumer.FleetConsumer
    assert custom_consumer.SEEN.count(task_id) == 2
    assert runs == ["once"]
    assert skipped == [task_id]
    # and the gate is one step, the last call before the pool, with install(app) as well
    gate = consumer.claim_gate
    assert isinstance(gate, ClaimGate)
    assert not isinstance(gate.inner, ClaimGate)
    assert Gate in custom_consumer.FleetConsumer.Blueprint.default_steps
    assert len([s for s in consumer.blueprint.steps.values() if isinstance(s, Gate)]) == 1


def test_a_custom_consumer_with_the_mixin_refuses_to_run_without_install(
    redis_server: RedisServer, queue: str, key_prefix: str
) -> None:
    # Given an app with the mixin consumer but without install(app)
    app = make_app(
        redis_server.url,
        queue=queue,
        claims_prefix=key_prefix,
        plugin=False,
        worker_consumer=CONSUMER,
    )
    try:
        # When a worker starts, Then it refuses, naming what is missing
        with (
            pytest.raises(InvalidArgument, match=r"install\(app\)") as raised,
            in_process_worker(app),
        ):
            pass
    finally:
        close_app(app)
    assert raised.value.name == "worker_consumer"


def test_the_mixin_on_a_class_that_is_not_a_consumer_is_refused() -> None:
    # When the mixin goes on a class that has no consumer blueprint, Then the class is refused
    with pytest.raises(InvalidArgument, match="Consumer subclass"):
        type("NotAConsumer", (ClaimsConsumerMixin,), {})
