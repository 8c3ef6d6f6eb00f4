"""celery-claims: exactly-once-ish task execution and fleet-wide capacity limits for Celery.

``celery_claims.install(app)`` makes a Celery app claim-aware, and ``current_claim()`` gives
task code its claim (with the fencing number). The claim core imported here does not import
Celery: those two are loaded on first use, so ``import celery_claims`` stays cheap for code
that only uses claims (and lanes, from ``celery_claims.lanes``).
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
    GivenUp,
    Success,
    TookOver,
)

if TYPE_CHECKING:
    # from the defining modules: ``celery_claims.worker.install`` is also a module's name
    from celery_claims.worker.delivery.guard import current_claim
    from celery_claims.worker.install import install

__version__ = "0.1.0"


#: Names served by the Celery integration, imported on first use (PEP 562).
_FROM_WORKER = ("current_claim", "install")


def __getattr__(name: str) -> Any:
    if name in _FROM_WORKER:
        from celery_claims import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'celery_claims' has no attribute {name!r}")


__all__ = [
    # the Celery integration
    "current_claim",
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
    "GivenUp",
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
