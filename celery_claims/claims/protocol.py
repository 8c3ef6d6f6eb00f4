"""The ``ClaimManager`` interface: the port of the Rust ``AtomicClaimManager``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from celery_claims.errors import ClaimTokenError
from celery_claims.model import (
    DEFAULT_GIVEN_UP_TTL_MS,
    AlreadyDone,
    ClaimResult,
    ClaimStats,
    ClaimToken,
    GateResult,
    GivenUp,
)

__all__ = ["ClaimManager"]


@runtime_checkable
class ClaimManager(Protocol):
    """Atomic, leased task ownership.

    The first nine methods are the Rust ``AtomicClaimManager``'s API with its exact semantics (see
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

        The task's takeover count (see ``claim_unless_done``) goes with it.

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

        Their takeover counts go with them, and records past their retention are purged.

        Args:
            limit: stop after removing about this many (``None``: remove them all); which
                expired claims a limited run removes first is up to the backend.
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
        self,
        queue_id: str,
        task_id: str,
        owner: str,
        lease_ms: int,
        *,
        max_takeovers: int | None = None,
        given_up_ttl_ms: int = DEFAULT_GIVEN_UP_TTL_MS,
        run: int | None = None,
    ) -> GateResult:
        """Like ``claim``, but answer the task's record instead when it has a live one.

        A live completion record answers ``AlreadyDone``, a live given-up record ``GivenUp``.
        With ``max_takeovers`` set, the task's takeovers are counted; the takeover that would
        make the count exceed ``max_takeovers`` is refused: the expired claim and the count are
        removed, a given-up record is kept for ``given_up_ttl_ms``, and the answer is
        ``GivenUp`` (so 0 refuses the first takeover). ``None`` neither counts nor limits.

        What is counted is a holder that may have died of the task: the takeover of the
        task's first claim (whose start is not marked), and of a claim granted by a takeover
        whose holder marked its start (``mark_started``). A takeover's holder that died
        before it started the task (a worker killed with the task still in its prefetch) is
        taken over again without counting, so an innocent task is not given up as poison
        because its workers kept dying around it.

        Args:
            queue_id: the task's queue.
            task_id: the task.
            owner: the execution attempt asking.
            lease_ms: the lease if the claim is granted.
            max_takeovers: takeovers granted before the task is given up, or ``None``.
            given_up_ttl_ms: how long a given-up record answers later copies (0: not kept).
            run: the run asking (:mod:`celery_claims.runs`), or ``None``. A completion record
                whose owner names an earlier run is not answered: the claim is made as if
                there were none, and the record stays until this claim's completion
                replaces it. Records of the same or a later run, records naming no run and
                given-up records are answered as without it.

        Returns:
            ``Success``, ``TookOver``, ``AlreadyClaimed``, ``AlreadyDone`` or ``GivenUp``.

        Raises:
            InvalidArgument: as ``claim``; ``max_takeovers`` not ``None`` or an int >= 0 (a
                bool is refused); ``given_up_ttl_ms`` out of range; ``run`` not ``None`` or
                an int in ``1..2**53-1``.
            BackendUnavailable: the claim store could not be reached.
        """
        ...

    def mark_started(self, token: ClaimToken) -> None:
        """Record that the holder of ``token`` started the task (see ``claim_unless_done``).

        Only a claim granted by a takeover under a takeover limit needs it; for any other
        claim it changes nothing. Idempotent.

        Raises:
            InvalidArgument: a malformed token.
            ClaimNotFound, StaleClaimToken, NotClaimOwner: as ``release``; nothing is written.
            BackendUnavailable: the claim store could not be reached.
        """
        ...

    def complete(self, token: ClaimToken, done_ttl_ms: int) -> None:
        """Release the claim and keep a completion record for ``done_ttl_ms``, atomically.

        Like ``release``, it clears the task's takeover count.

        Raises the same errors as ``release``; on error nothing is recorded.
        """
        ...

    def done_record(self, queue_id: str, task_id: str) -> AlreadyDone | GivenUp | None:
        """The task's live record, as ``claim_unless_done`` would answer it.

        ``AlreadyDone`` for a completed task, ``GivenUp`` for one given up as poison, ``None``
        when no record is retained.
        """
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
