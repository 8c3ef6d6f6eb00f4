"""Fixtures of the worker tests: a private broker/claim store and per-test names."""

from __future__ import annotations

import contextlib
import socket
import sys
from collections.abc import Iterator

import pytest
from kombu import Connection

from celery_claims import RedisClaimManager
from tests.servers import (
    MotoServer,
    RabbitMQServer,
    RedisServer,
    missing_service,
    moto_server,
    rabbitmq_server,
    redis_server,
)
from tests.worker.helpers import RABBITMQ_URL, unique
from tests.worker.processes import Fleet


@pytest.fixture
def queue() -> str:
    """A queue name no other test uses (so a shared broker never mixes tests' messages)."""
    return unique("q")


@pytest.fixture
def claims(store_server: RedisServer, key_prefix: str) -> Iterator[RedisClaimManager]:
    """The test's view of the claim store the workers use (the session's private server,
    the Redis unless the test runs on every server; a prefix of its own)."""
    manager = RedisClaimManager(url=store_server.url, prefix=key_prefix)
    try:
        yield manager
    finally:
        manager.client.close()


#: Set on a test item whose call failed (read by :func:`fleet` at teardown).
CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    if getattr(report, "when", None) == "call" and getattr(report, "failed", False):
        item.stash[CALL_FAILED] = True
    return report


@pytest.fixture
def fleet(request: pytest.FixtureRequest) -> Iterator[Fleet]:
    """Worker/beat subprocesses of one test; every process group is killed at the end. Where
    the test failed, the tail of each process's log goes to the failure's report (its
    captured teardown output): a failure that happens once in a while in CI says what the
    workers did."""
    procs = Fleet()
    try:
        yield procs
    finally:
        if request.node.stash.get(CALL_FAILED, False):
            print(procs.logs(), file=sys.stderr)
        procs.cleanup()


@pytest.fixture
def private_redis(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A Redis of this test alone (broker, result backend and claim store of its fleet); a
    Valkey when the test is parametrized so (``on_every_private_server``)."""
    with redis_server(kind=getattr(request, "param", "redis")) as server:
        yield server


@pytest.fixture(params=["redis", pytest.param("rabbitmq", marks=pytest.mark.rabbitmq)])
def broker(request: pytest.FixtureRequest, private_redis: RedisServer) -> Iterator[str]:
    """The broker URL: the test's private Redis, or the machine's RabbitMQ (a test that uses
    RabbitMQ adds its queue names to ``request.node.rabbitmq_queues``: they are deleted after
    it)."""
    if request.param == "redis":
        yield private_redis.url
        return
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
    except OSError:
        missing_service("RabbitMQ at 127.0.0.1:5672")
    queues: list[str] = []
    request.node.rabbitmq_queues = queues
    yield RABBITMQ_URL
    with Connection(RABBITMQ_URL) as conn:
        for name in queues:
            with contextlib.suppress(Exception):
                conn.default_channel.queue_delete(name)


@pytest.fixture(scope="module")
def private_rabbitmq(request: pytest.FixtureRequest) -> Iterator[RabbitMQServer]:
    """A RabbitMQ node of this module alone, beside the machine's (its own name and ports).

    Its ``consumer_timeout`` in ms is the fixture's parameter (indirect parametrization:
    ``@pytest.mark.parametrize("private_rabbitmq", [5000], indirect=True)``); without one,
    RabbitMQ's default (30 minutes). Tests sharing it use queues of their own (``queue``).
    Missing ``rabbitmq-server``: a skip, or a failure under CI.
    """
    consumer_timeout_ms = getattr(request, "param", None)
    with rabbitmq_server(consumer_timeout_ms=consumer_timeout_ms) as server:
        yield server


@pytest.fixture(scope="module")
def private_sqs() -> Iterator[MotoServer]:
    """Amazon SQS of this module alone: a moto server on a free port, stopped by its pid.
    Tests sharing it use queues of their own (``queue``). Missing moto's server mode, boto3
    or pycurl (kombu's SQS consumer needs it): a skip, or a failure under CI."""
    with moto_server() as server:
        yield server
