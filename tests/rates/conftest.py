"""The rate limiters every rate contract test runs against: memory, Redis and Redis Cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest

from celery_claims.rates import Limit, MemoryRateLimiter, RateLimiter, RedisRateLimiter
from celery_claims.testing import ManualClock
from tests.servers import RedisClusterNodes, RedisServer


@dataclass
class Backend:
    """A limiter on a manual clock, one on the live clock (the server's, for Redis), and ways
    to read the state they keep."""

    name: str
    limiter: RateLimiter
    clock: ManualClock
    live: RateLimiter
    snapshot: Callable[[], object]
    #: ``kept(limiter, scope, limits)``: the names of ``limits`` whose state ``limiter`` keeps
    kept: Callable[[RateLimiter, str, Sequence[Limit]], set[str]]


def memory_kept(limiter: RateLimiter, scope: str, limits: Sequence[Limit]) -> set[str]:
    assert isinstance(limiter, MemoryRateLimiter)
    names = {limit.name for limit in limits}
    return {name for (s, name) in limiter.stored() if s == scope and name in names}


def redis_kept(limiter: RateLimiter, scope: str, limits: Sequence[Limit]) -> set[str]:
    assert isinstance(limiter, RedisRateLimiter)
    return {limit.name for limit in limits if limiter.client.exists(*limiter.keys(scope, [limit]))}


def redis_snapshot(limiter: RedisRateLimiter) -> dict[bytes, bytes | None]:
    """Every key of the limiter's prefix, DUMPed."""
    client = limiter.client
    keys = sorted(client.scan_iter(match=f"{limiter.prefix}:*", count=1000))
    return {key: client.dump(key) for key in keys}


@pytest.fixture(params=["memory", "redis", pytest.param("cluster", marks=pytest.mark.cluster)])
def backend(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[Backend]:
    clock = ManualClock()
    if request.param == "memory":
        memory = MemoryRateLimiter(clock=clock)
        yield Backend("memory", memory, clock, MemoryRateLimiter(), memory.stored, memory_kept)
        return
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        client = server.client()
    else:
        cluster: RedisClusterNodes = request.getfixturevalue("redis_cluster")
        client = cluster.client()
    limiter = RedisRateLimiter(client=client, prefix=key_prefix, clock=clock)
    live = RedisRateLimiter(client=client, prefix=f"{key_prefix}live")
    try:
        yield Backend(
            request.param, limiter, clock, live, lambda: redis_snapshot(limiter), redis_kept
        )
    finally:
        client.close()
