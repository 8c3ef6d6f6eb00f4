"""The backends every contract test runs against: memory, Redis, Valkey and Redis Cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from celery_claims import ClaimManager, MemoryClaimManager, RedisClaimManager
from celery_claims.testing import ManualClock
from tests.servers import RedisClusterNodes, RedisServer


@dataclass
class Backend:
    """A claim manager under test, its manual clock, and a way to snapshot its whole state."""

    name: str
    manager: ClaimManager
    clock: ManualClock
    snapshot: Callable[[], object]


def redis_snapshot(manager: RedisClaimManager) -> dict[bytes, bytes]:
    """Every key of the manager's prefix, DUMPed: byte-for-byte state of the store."""
    client = manager.client
    keys = sorted(client.scan_iter(match=f"{manager.prefix}:*", count=1000))
    return {key: client.dump(key) for key in keys}


def memory_snapshot(manager: MemoryClaimManager) -> object:
    queues = manager._queues  # the specification's own state, read for comparison only
    return {
        queue_id: (
            dict(q.claims),
            dict(q.done),
            dict(q.takeovers),
            set(q.unstarted),
            q.last_instance,
            q.stats,
        )
        for queue_id, q in queues.items()
    }


def record_tasks(backend: Backend, queue_id: str) -> set[str]:
    """The tasks with a stored record (done or given up, live or not yet purged)."""
    manager = backend.manager
    if isinstance(manager, RedisClaimManager):
        return {k.decode() for k in manager.client.hkeys(manager.keys(queue_id).done)}
    assert isinstance(manager, MemoryClaimManager)
    queue = manager._queues.get(queue_id)  # the specification's own state, read only
    return set() if queue is None else set(queue.done)


def takeover_counts(backend: Backend, queue_id: str) -> dict[str, int]:
    """The per-task takeover counts the backend keeps for ``queue_id`` (its raw state)."""
    manager = backend.manager
    if isinstance(manager, RedisClaimManager):
        # counted inside the claim entries: read every entry of the queue
        tasks = [k.decode() for k in manager.client.hkeys(manager.keys(queue_id).claims)]
        stored = manager.read(queue_id, tasks) if tasks else []
        return {s.task_id: s.takeovers for s in stored if s.takeovers}
    assert isinstance(manager, MemoryClaimManager)
    queue = manager._queues.get(queue_id)  # the specification's own state, read only
    return {} if queue is None else dict(queue.takeovers)


@pytest.fixture(
    params=[
        "memory",
        "redis",
        pytest.param("valkey", marks=pytest.mark.valkey),
        pytest.param("cluster", marks=pytest.mark.cluster),
    ]
)
def backend(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[Backend]:
    clock = ManualClock()
    if request.param == "memory":
        memory = MemoryClaimManager(clock=clock)
        yield Backend("memory", memory, clock, lambda: memory_snapshot(memory))
        return
    if request.param in ("redis", "valkey"):
        server: RedisServer = request.getfixturevalue(f"{request.param}_server")
        client = server.client()
    else:
        cluster: RedisClusterNodes = request.getfixturevalue("redis_cluster")
        client = cluster.client()
    manager = RedisClaimManager(client=client, prefix=key_prefix, clock=clock)
    try:
        yield Backend(request.param, manager, clock, lambda: redis_snapshot(manager))
    finally:
        client.close()


@pytest.fixture
def manager(backend: Backend) -> ClaimManager:
    return backend.manager


@pytest.fixture
def clock(backend: Backend) -> ManualClock:
    return backend.clock
