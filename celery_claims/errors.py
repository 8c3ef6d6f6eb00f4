"""The one error tree of celery-claims.

Every error the package raises derives from :class:`ClaimError` and carries its context as
attributes, so callers never parse messages. Driver errors (redis-py, SQLAlchemy) are
translated at the backend boundary into :class:`BackendError` subclasses. The lanes keep the
names of the Rust ``TaskClaimStore`` they port, as classes of the same tree: a bad argument is
an :class:`InvalidArgument` (``InvalidValueError`` in lanes) and a failing store a
:class:`BackendUnavailable` (``IoError`` in lanes), whichever API raised it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery_claims.model import ClaimToken

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "ClaimError",
    "ClaimNotFound",
    "ClaimTokenError",
    "CodecError",
    "InsufficientReplicas",
    "InvalidArgument",
    "InvalidValueError",
    "IoError",
    "KeyRefused",
    "LeaseLost",
    "LeaseRenewalTimedOut",
    "NotClaimOwner",
    "StaleClaimToken",
    "TaskCoreError",
    "TaskNotFound",
    "WorkerShutdownRequested",
]


class ClaimError(Exception):
    """Root of every error raised by celery-claims."""


class InvalidArgument(ClaimError, ValueError):
    """An argument failed validation; nothing was changed.

    Attributes:
        name: the parameter that was rejected.
    """

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name

    @classmethod
    def about(cls, name: str, message: str) -> InvalidArgument:
        """The error for argument ``name`` and what is wrong with it (the shared checks of
        :mod:`celery_claims.validation` raise through this, so each API words it its way)."""
        return cls(name, message)


class KeyRefused(InvalidArgument):
    """A message's claim key cannot be made from its arguments (a keyed task, ``claims_key``).

    The worker records the task as failed with this error and acknowledges the message, as
    Celery fails a task whose arguments do not bind: it is never run unkeyed, nor lost.

    Attributes:
        name: ``<task name>.claims_key``.
        task_name: the task.
    """

    def __init__(self, task_name: str, message: str) -> None:
        super().__init__(f"{task_name}.claims_key", message)
        self.task_name = task_name
        self.message = message
        # a result backend stores ``args`` and rebuilds the error with ``cls(*args)``
        self.args = (task_name, message)

    def __str__(self) -> str:
        return f"{self.name}: {self.message}"


class BackendError(ClaimError):
    """The claim store answered with an error the package did not expect."""


class BackendUnavailable(BackendError):
    """The claim store could not be reached (connection refused, timeout, loading, failover)."""


class InsufficientReplicas(BackendError):
    """A write reached the primary but fewer replicas than asked acknowledged it in time.

    The write is not undone: a failover before replication could lose it. ``result`` holds
    what the primary answered, so the caller can decide (the Celery gate retries later).

    Attributes:
        result: the operation's outcome on the primary (``None`` for release and complete).
        acknowledged: how many replicas acknowledged the write.
        required: how many were asked for.
    """

    def __init__(self, result: object, acknowledged: int, required: int) -> None:
        super().__init__(
            f"only {acknowledged} of {required} replicas acknowledged the write in time"
        )
        self.result = result
        self.acknowledged = acknowledged
        self.required = required


class ClaimTokenError(ClaimError):
    """A token was refused by ``release`` or ``extend``; nothing was changed.

    Attributes:
        token: the token that was refused.
    """

    #: The message of the Rust ``AtomicClaimManager``, kept verbatim.
    message = "Claim token refused"

    def __init__(self, token: ClaimToken) -> None:
        super().__init__(
            f"{self.message}: queue={token.queue_id!r} task={token.task_id!r} "
            f"owner={token.owner!r} instance={token.instance}"
        )
        self.token = token


class ClaimNotFound(ClaimTokenError):
    """No claim exists for the token's task (released, cleaned up, or never claimed)."""

    message = "Claim not found"


class StaleClaimToken(ClaimTokenError):
    """The claim exists but was re-claimed or taken over since this token was issued."""

    message = "Stale claim token"


class NotClaimOwner(ClaimTokenError):
    """The claim's instance matches but its owner does not (a forged or altered token)."""

    message = "Not claim owner"


# --- lanes (the port of the Rust TaskClaimStore's TaskCoreError)
# -------------------------------------------


class TaskCoreError(ClaimError):
    """Root of the lane-claiming errors (the Rust ``TaskClaimStore``'s ``TaskCoreError``)."""


class CodecError(TaskCoreError):
    """A stored task record could not be encoded or decoded."""


class InvalidValueError(TaskCoreError, InvalidArgument):
    """A value the lane algorithm or a store refuses; nothing was changed. The lanes' name of
    :class:`InvalidArgument`, worded as the Rust ``TaskClaimStore``'s (``task_id must be ...``).

    Attributes:
        name: the rejected argument, or ``"value"`` where no one argument is to blame.
    """

    def __init__(self, message: str, *, name: str = "value") -> None:
        ValueError.__init__(self, message)  # the whole message, not InvalidArgument's "name: "
        self.name = name

    @classmethod
    def about(cls, name: str, message: str) -> InvalidValueError:
        """The error for argument ``name``: ``<name> <message>``."""
        return cls(f"{name} {message}", name=name)


class TaskNotFound(InvalidValueError):
    """No task of the lane store has this id, or none of the lane a claim was for; nothing
    was changed.

    Attributes:
        task_id: the id.
        lane: the lane of the claim that named the task, or ``None`` outside a claim.
    """

    def __init__(self, task_id: int, lane: object = None) -> None:
        self.message = (
            f"unknown task id {task_id}"
            if lane is None
            else f"candidate task {task_id} is not a task of lane {lane!r}"
        )
        super().__init__(self.message, name="task_id")
        self.task_id = task_id
        self.lane = lane
        # pickling rebuilds the error with ``cls(*args)``
        self.args = (task_id, lane)

    def __str__(self) -> str:
        return self.message


class IoError(TaskCoreError, BackendUnavailable):
    """The lane store failed to read or write (the driver's error is the cause); the lanes'
    name of :class:`BackendUnavailable`."""


class _LeaseError(TaskCoreError):
    """A lease-related failure of one processing attempt."""

    def __init__(self, task_id: int, processing_token: int, message: str = "") -> None:
        super().__init__(
            message or f"{type(self).__name__}: task {task_id} token {processing_token}"
        )
        self.task_id = task_id
        self.processing_token = processing_token


class LeaseLost(_LeaseError):
    """Another worker now holds the task: this attempt must stop without recording anything."""


class LeaseRenewalTimedOut(_LeaseError):
    """The lease could not be renewed in time; the attempt can no longer prove ownership."""


class WorkerShutdownRequested(_LeaseError):
    """The worker is shutting down; the attempt should stop and leave the task claimable."""
