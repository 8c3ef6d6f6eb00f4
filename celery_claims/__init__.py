"""celery-claims: exactly-once-ish task execution and fleet-wide capacity limits for Celery.

``celery_claims.install(app)`` makes a Celery app claim-aware. The claim core imported here
does not import Celery: ``install`` is loaded on first use, so ``import celery_claims`` stays
cheap for code that only uses claims (and lanes, from ``celery_claims.lanes``).
"""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from celery_claims.worker import install

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # PEP 562: the Celery integration is imported only when ``install`` is first used
    if name == "install":
        from celery_claims.worker import install

        return install
    raise AttributeError(f"module 'celery_claims' has no attribute {name!r}")


__all__ = [
    # the Celery integration
    "install",
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
