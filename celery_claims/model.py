"""Value types of the claim protocol: tokens, results, statistics and status codes."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal, TypeAlias

__all__ = [
    "AlreadyClaimed",
    "AlreadyDone",
    "ClaimResult",
    "ClaimStats",
    "ClaimStatus",
    "ClaimToken",
    "DEFAULT_GIVEN_UP_TTL_MS",
    "GateResult",
    "GivenUp",
    "Success",
    "TookOver",
]


class ClaimStatus(enum.IntEnum):
    """Status codes shared by the Lua scripts and the in-memory backend."""

    SUCCESS = 1
    ALREADY_CLAIMED = 2
    TOOK_OVER = 3
    NOT_FOUND = 4
    STALE = 5
    NOT_OWNER = 6
    DONE = 7
    GIVEN_UP = 8


@dataclass(frozen=True, slots=True)
class ClaimToken:
    """Proof of one claim: which task, who holds it, which instance, until when.

    Attributes:
        queue_id: the queue the task belongs to.
        task_id: the task within the queue.
        owner: the execution attempt that holds the claim.
        instance: the fencing number; strictly larger for every later claim of the task.
        created_at: epoch ms when this instance was claimed.
        expires_at: epoch ms when the lease ends (the claim is expired at ``now >= expires_at``).
    """

    queue_id: str
    task_id: str
    owner: str
    instance: int
    created_at: int
    expires_at: int

    def is_valid(self, now_ms: int) -> bool:
        """True while the lease runs: ``now_ms < expires_at``."""
        return now_ms < self.expires_at

    def remaining_ms(self, now_ms: int) -> int:
        """Milliseconds of lease left at ``now_ms``, never negative."""
        return max(self.expires_at - now_ms, 0)


@dataclass(frozen=True, slots=True)
class Success:
    """The task was free (or held by the same owner) and is now claimed."""

    token: ClaimToken

    @property
    def acquired(self) -> Literal[True]:
        """Always true: the caller holds the claim."""
        return True


class _NothingAcquired:
    """What every refusal answers: ``acquired`` is false and there is no token."""

    __slots__ = ()

    @property
    def acquired(self) -> Literal[False]:
        """Always false: nothing was acquired."""
        return False

    @property
    def token(self) -> None:
        """No token: nothing was acquired."""
        return None


@dataclass(frozen=True, slots=True)
class AlreadyClaimed(_NothingAcquired):
    """Another owner holds an unexpired claim on the task."""

    owner: str
    expires_at: int


@dataclass(frozen=True, slots=True)
class TookOver:
    """Another owner's claim had expired; it now belongs to the caller."""

    previous_owner: str
    token: ClaimToken

    @property
    def acquired(self) -> Literal[True]:
        """Always true: the caller holds the claim."""
        return True


@dataclass(frozen=True, slots=True)
class AlreadyDone(_NothingAcquired):
    """The task was completed within the retention period; it must not run again.

    Only returned by ``claim_unless_done``, never by the Rust ``AtomicClaimManager``'s ``claim``.
    """

    owner: str
    instance: int
    done_at: int


@dataclass(frozen=True, slots=True)
class GivenUp(_NothingAcquired):
    """The task was given up as poison: its claim was taken over too often; it must not run.

    Only returned by ``claim_unless_done`` with ``max_takeovers`` set (the copy that would have
    made one takeover too many), and for every later copy while the record is kept; ``done_record``
    answers it too. The expired claim is removed when the task is given up.

    Attributes:
        previous_owner: the owner whose expired claim was the last one (the last worker lost).
        takeovers: how many takeovers of the task had been granted when it was given up.
        given_up_at: epoch ms when it was given up.
    """

    previous_owner: str
    takeovers: int
    given_up_at: int


#: The outcome of ``ClaimManager.claim``.
ClaimResult: TypeAlias = Success | AlreadyClaimed | TookOver

#: The outcome of ``ClaimManager.claim_unless_done``: a claim result, or the task's record
#: (completed, or given up as poison).
GateResult: TypeAlias = Success | AlreadyClaimed | TookOver | AlreadyDone | GivenUp

#: How long a given-up record is kept by default, ms: the default completion retention, since a
#: later copy of a given-up task may arrive as late as one of a completed task.
DEFAULT_GIVEN_UP_TTL_MS = 24 * 3600 * 1000


@dataclass(frozen=True, slots=True)
class ClaimStats:
    """Counters of a claim manager (summed over queues).

    ``nacks`` is kept for parity with the Rust ``AtomicClaimManager``, which declares it but never
    counts it.
    """

    attempts: int = 0
    successes: int = 0
    contentions: int = 0
    takeovers: int = 0
    acks: int = 0
    nacks: int = 0
    expirations: int = 0

    def __add__(self, other: ClaimStats) -> ClaimStats:
        return ClaimStats(
            attempts=self.attempts + other.attempts,
            successes=self.successes + other.successes,
            contentions=self.contentions + other.contentions,
            takeovers=self.takeovers + other.takeovers,
            acks=self.acks + other.acks,
            nacks=self.nacks + other.nacks,
            expirations=self.expirations + other.expirations,
        )
