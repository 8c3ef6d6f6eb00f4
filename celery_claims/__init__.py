"""celery-claims: exactly-once-ish task execution and fleet-wide capacity limits for Celery."""

from celery_claims.claims import ClaimManager, MemoryClaimManager, RedisClaimManager
from celery_claims.errors import (
    BackendError,
    BackendUnavailable,
    ClaimError,
    ClaimNotFound,
    ClaimTokenError,
    InsufficientReplicas,
    InvalidArgument,
    NotClaimOwner,
    StaleClaimToken,
)
from celery_claims.model import (
    AlreadyClaimed,
    AlreadyDone,
    ClaimResult,
    ClaimStats,
    ClaimToken,
    GateResult,
    Success,
    TookOver,
)

__version__ = "0.1.0"

__all__ = [
    # claim managers
    "ClaimManager",
    "MemoryClaimManager",
    "RedisClaimManager",
    # values
    "AlreadyClaimed",
    "AlreadyDone",
    "ClaimResult",
    "ClaimStats",
    "ClaimToken",
    "GateResult",
    "Success",
    "TookOver",
    # errors
    "BackendError",
    "BackendUnavailable",
    "ClaimError",
    "ClaimNotFound",
    "ClaimTokenError",
    "InsufficientReplicas",
    "InvalidArgument",
    "NotClaimOwner",
    "StaleClaimToken",
    # metadata
    "__version__",
]
