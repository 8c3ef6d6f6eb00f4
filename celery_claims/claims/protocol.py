"""The ``ClaimManager`` interface: the port of the original ``AtomicClaimManager``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from celery_claims.errors import ClaimTokenError
from celery_claims.model import AlreadyDone, ClaimResult, ClaimStats, ClaimToken, GateResult

__all__ = ["ClaimManager"]


@runtime_checkable
class ClaimManager(Protocol):
    """Atomic, leased task ownership.

    The first nine methods are the original API with its exact semantics (see
    ``docs/semantics.md``). ``claim_unless_done``, ``complete``, ``done_record`` and ``renew``
    are additions the Celery integration needs to stay at one round trip per message.
    """

    def claim(self, queue_id: str, task_id: str, owner: str, lease_ms: int) -> ClaimResult:
        """Try to take the claim on ``task_id``.

        Returns ``Success`` when the task was free or already the caller's (a re-claim issues a
        new instance), ``TookOver`` when another owner's lease had expired, ``AlreadyClaimed``
        while another owner's lease runs.

        Raises:
            InvalidArgument: an id is not a non-empty str or the lease is out of range.
            BackendUnavailable: the claim store could not be reached.
        """
        ...

    def release(self, token: ClaimToken) -> None:
        """Remove the claim ``token`` describes (an acknowledgement). Expiry is not checked.

        Raises:
            ClaimNotFound: no claim exists for the task.
            StaleClaimToken: the claim was re-claimed or taken over since ``token`` was issued.
            NotClaimOwner: the claim's owner is not ``token.owner``.
        """
        ...

    def extend(self, queue_id: str, token: ClaimToken, additional_ms: int) -> ClaimToken:
        """Add ``additional_ms`` to the claim's current expiry (not to now).

        The claim is looked up in ``queue_id``, not ``token.queue_id``. Instance and
        ``created_at`` are kept. Raises the same errors, in the same order, as ``release``.
        """
        ...

    def is_claimed(self, queue_id: str, task_id: str) -> tuple[str, int] | None:
        """``(owner, expires_at)`` of the unexpired claim on the task, else ``None``."""
        ...

    def get_token(self, queue_id: str, task_id: str, owner: str) -> ClaimToken | None:
        """The unexpired claim's token if ``owner`` holds it, else ``None``."""
        ...

    def cleanup_expired(self, *, limit: int | None = None) -> int:
        """Remove expired claims of every queue; count them in ``expirations``; return the count.

        Args:
            limit: stop after removing about this many (``None``: remove them all).
        """
        ...

    def stats(self) -> ClaimStats:
        """The counters, summed over every queue."""
        ...

    def active_claims(self, queue_id: str) -> int:
        """Number of unexpired claims in the queue."""
        ...

    def list_claims(self, queue_id: str) -> list[ClaimToken]:
        """Tokens of the unexpired claims in the queue, soonest expiry first."""
        ...

    # --- additions for the Celery integration -------------------------------------------------

    def claim_unless_done(
        self, queue_id: str, task_id: str, owner: str, lease_ms: int
    ) -> GateResult:
        """Like ``claim``, but answer ``AlreadyDone`` if the task has a completion record."""
        ...

    def complete(self, token: ClaimToken, done_ttl_ms: int) -> None:
        """Release the claim and keep a completion record for ``done_ttl_ms``, atomically.

        Raises the same errors as ``release``; on error nothing is recorded.
        """
        ...

    def done_record(self, queue_id: str, task_id: str) -> AlreadyDone | None:
        """The task's completion record, if one is retained."""
        ...

    def renew(
        self, queue_id: str, tokens: Sequence[ClaimToken], lease_ms: int
    ) -> list[ClaimToken | ClaimTokenError]:
        """Renew many claims of one queue at once: ``expires_at = max(expires_at, now + lease)``.

        Each token is checked like ``extend`` (not found, stale, other owner); a refused token
        yields its error in the result list instead of raising, so one lost claim does not hide
        the others. Statistics are unchanged.
        """
        ...
