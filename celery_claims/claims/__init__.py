"""Claims: the ``ClaimManager`` protocol and its backends."""

from celery_claims.claims.memory import MemoryClaimManager
from celery_claims.claims.protocol import ClaimManager
from celery_claims.claims.redis import RedisClaimManager

__all__ = ["ClaimManager", "MemoryClaimManager", "RedisClaimManager"]
