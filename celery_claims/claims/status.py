"""The mapping from status codes to token errors, shared by every backend."""

from __future__ import annotations

from celery_claims.errors import (
    BackendError,
    ClaimNotFound,
    ClaimTokenError,
    NotClaimOwner,
    StaleClaimToken,
)
from celery_claims.model import ClaimStatus, ClaimToken

__all__ = ["token_error"]

_TOKEN_ERRORS: dict[int, type[ClaimTokenError]] = {
    ClaimStatus.NOT_FOUND: ClaimNotFound,
    ClaimStatus.STALE: StaleClaimToken,
    ClaimStatus.NOT_OWNER: NotClaimOwner,
}


def token_error(status: int, token: ClaimToken) -> ClaimTokenError:
    """The error for a refused token, or :class:`BackendError` for a code no backend sends."""
    try:
        return _TOKEN_ERRORS[status](token)
    except KeyError:
        raise BackendError(f"unknown claim status code {status!r}") from None
