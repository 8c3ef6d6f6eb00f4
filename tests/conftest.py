"""Session-wide fixtures: private Redis servers and a private Redis Cluster.

Tests never use the machine's shared Redis for state they assert on: every session starts its
own ``redis-server`` processes on free ports and stops them by pid at the end.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from tests.servers import RedisClusterNodes, RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private standalone Redis for the whole session (flush it yourself if you need to)."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


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
