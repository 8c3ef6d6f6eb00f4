"""The worker's one claim store client factory, with one timeout and retry policy.

Every part of a worker reaches the claim store through :func:`new_manager`: the claim gate
and the lease keeper in the main process, and the guard in each pool process (a prefork child
builds its own, never sharing the parent's sockets across fork).

The policy: socket connect and read timeouts of ``claims_socket_timeout_ms``, and one
immediate retry (for a connection an idle timeout dropped), no backoff. redis-py's default
(several retries with exponential backoff) would block the consumer loop or a running task
for seconds on a dead store; every caller here has its own, slower retry instead (held
copies back off, the keeper retries each beat).
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.worker.settings import ClaimsSettings

__all__ = ["new_manager"]

#: How often a failed call is retried at once (a dropped idle connection reconnects).
RETRIES = 1


def new_manager(settings: ClaimsSettings) -> RedisClaimManager:
    """A claim manager for ``settings`` (see the module docstring for its policy)."""
    timeout_s = settings.socket_timeout_ms / 1000
    client = redis.Redis.from_url(
        settings.redis_url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), RETRIES),
        health_check_interval=30,
    )
    return RedisClaimManager(client=client, prefix=settings.prefix)
