"""Fixtures of the worker tests: a private broker/claim store and per-test names."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_claims import RedisClaimManager
from tests.servers import RedisServer, redis_server
from tests.worker.helpers import unique
from tests.worker.processes import Fleet


@pytest.fixture
def queue() -> str:
    """A queue name no other test uses (so a shared broker never mixes tests' messages)."""
    return unique("q")


@pytest.fixture
def claims(redis_server: RedisServer, key_prefix: str) -> Iterator[RedisClaimManager]:
    """The test's view of the claim store the workers use (the private Redis, own prefix)."""
    manager = RedisClaimManager(url=redis_server.url, prefix=key_prefix)
    try:
        yield manager
    finally:
        manager.client.close()


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    """Worker/beat subprocesses of one test; every process group is killed at the end."""
    procs = Fleet()
    try:
        yield procs
    finally:
        procs.cleanup()


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A Redis of this test alone (broker, result backend and claim store of its fleet)."""
    with redis_server() as server:
        yield server
