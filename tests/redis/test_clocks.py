"""Whose clock judges expiry: the server's by default, the caller's when asked (freezegun)."""

from __future__ import annotations

import time

import pytest
import redis
from freezegun import freeze_time

from celery_claims import (
    AlreadyClaimed,
    MemoryClaimManager,
    RedisClaimManager,
    Success,
    TookOver,
)
from celery_claims.clock import system_clock_ms

Q = "emails"


def test_memory_backend_follows_freezegun() -> None:
    manager = MemoryClaimManager()
    with freeze_time("2026-01-01 00:00:00") as frozen:
        first = manager.claim(Q, "t1", "worker-1", 30_000)
        assert first.token is not None
        assert first.token.created_at == 1_767_225_600_000

        frozen.tick(29.999)
        assert isinstance(manager.claim(Q, "t1", "worker-2", 30_000), AlreadyClaimed)
        frozen.tick(0.001)
        assert isinstance(manager.claim(Q, "t1", "worker-2", 30_000), TookOver)


def test_redis_backend_with_a_client_clock_follows_freezegun(redis_client: redis.Redis) -> None:
    manager = RedisClaimManager(client=redis_client, clock=system_clock_ms)
    with freeze_time("2026-01-01 00:00:00") as frozen:
        first = manager.claim(Q, "t1", "worker-1", 30_000)
        assert first.token is not None
        assert first.token.created_at == 1_767_225_600_000

        frozen.tick(29.999)
        assert isinstance(manager.claim(Q, "t1", "worker-2", 30_000), AlreadyClaimed)
        assert manager.active_claims(Q) == 1
        frozen.tick(0.001)
        assert manager.active_claims(Q) == 0
        assert isinstance(manager.claim(Q, "t1", "worker-2", 30_000), TookOver)


def test_a_worker_whose_clock_is_60_s_ahead_cannot_take_over_a_live_claim(
    redis_client: redis.Redis,
) -> None:
    holder = RedisClaimManager(client=redis_client)  # server clock
    held = holder.claim(Q, "t1", "worker-1", 30_000)
    assert isinstance(held, Success)

    with freeze_time(time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(time.time() + 60))):
        # the skewed worker uses the server clock, as every production worker does
        skewed = RedisClaimManager(client=redis_client)
        assert isinstance(skewed.claim(Q, "t1", "worker-2", 30_000), AlreadyClaimed)
        assert skewed.is_claimed(Q, "t1") == ("worker-1", held.token.expires_at)

        # the same worker trusting its own clock would steal the live claim: the check can fail
        trusting = RedisClaimManager(client=redis_client, clock=system_clock_ms)
        assert isinstance(trusting.claim(Q, "t1", "worker-3", 30_000), TookOver)


def test_server_time_stamps_tokens_whatever_the_local_clock_says(
    redis_client: redis.Redis,
) -> None:
    seconds, micros = redis_client.time()
    server_ms = seconds * 1000 + micros // 1000
    with freeze_time("2001-01-01"):
        token = RedisClaimManager(client=redis_client).claim(Q, "t1", "w", 1_000).token

    assert token is not None
    assert token.created_at == pytest.approx(server_ms, abs=5_000)
