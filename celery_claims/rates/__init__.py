"""Fleet-wide rates: at most N task starts per period across the whole fleet (issue 32).

``parse_rate("10/m", name=...)`` reads Celery's spelling; a :class:`RateLimiter` counts a
start against one or more named :class:`Limit` s at once, atomically, by one clock
(:class:`RedisRateLimiter`, with :class:`MemoryRateLimiter` as its executable
specification). A refused start is told how long to wait, so a held copy is checked again
when its window frees, never polled. Imports neither Celery nor kombu.
"""

from celery_claims.rates.memory import MemoryRateLimiter
from celery_claims.rates.model import (
    MAX_LIMITS,
    MAX_RATE_COUNT,
    Limit,
    Rate,
    RateAllowed,
    RateLimited,
    RateResult,
    RateStatus,
    parse_rate,
)
from celery_claims.rates.protocol import RateLimiter
from celery_claims.rates.redis import RedisRateLimiter

__all__ = [
    # limiters
    "RateLimiter",
    "MemoryRateLimiter",
    "RedisRateLimiter",
    # values
    "Limit",
    "Rate",
    "RateAllowed",
    "RateLimited",
    "RateResult",
    "RateStatus",
    # the spelling
    "MAX_LIMITS",
    "MAX_RATE_COUNT",
    "parse_rate",
]
