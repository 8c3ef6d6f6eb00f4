"""Value types of lane claiming: lane configs, candidates, claims, leases and task records.

A *lane* is a set of task kinds with a limit on how many tasks of those kinds may be processing
at once, fleet-wide. These types are the port of the Rust ``TaskClaimStore``'s ``TaskLaneConfig``,
``TaskClaimCandidate``, ``ClaimedTask`` and ``TaskLease``; :class:`TaskRecord` is the concrete
task record the shipped stores return.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from celery_claims.errors import InvalidValueError, LeaseLost, TaskNotFound
from celery_claims.validation import require_int

__all__ = [
    "MAX_PROCESSING_TOKEN",
    "MAX_TASK_ID",
    "ClaimableTaskRecord",
    "ClaimedTask",
    "Kind",
    "Lane",
    "StoreStatus",
    "Task",
    "TaskClaimCandidate",
    "TaskLaneConfig",
    "TaskLease",
    "TaskRecord",
    "TaskStatus",
    "raise_for_status",
    "settle_status",
]

#: The largest processing token: the Rust ``TaskClaimStore`` stores tokens as ``i64``; a task whose
#: token has reached it can never be claimed again, and the lane pass that meets it is aborted.
MAX_PROCESSING_TOKEN = 2**63 - 1

#: The largest task id the shipped stores accept (a signed 64-bit database id).
MAX_TASK_ID = 2**63 - 1

#: The largest lane limit (the Rust ``TaskClaimStore``'s ``u64`` listing limit, kept within SQL's
#: ``BIGINT``).
MAX_LANE_LIMIT = 2**63 - 1

Kind = TypeVar("Kind", bound=Hashable)
Lane = TypeVar("Lane", bound=Hashable)
Task = TypeVar("Task")


class TaskStatus(str, enum.Enum):
    """Where a task is in its life; the shipped stores persist the lower-case value."""

    PENDING = "pending"
    RETRY = "retry"
    PROCESSING = "processing"
    DONE = "done"


@dataclass(frozen=True)
class TaskLaneConfig(Generic[Kind, Lane]):
    """A lane: the task kinds it covers and how many of them may be processing at once.

    Attributes:
        lane: the lane's identity (any hashable value, typically a ``str`` or an ``Enum``).
        kinds: the task kinds of the lane; non-empty, no duplicates, never shared by two lanes
            of one store.
        limit: how many tasks of the lane may hold a live lease at once; ``0`` pauses the lane.
            It is also the listing limit of one claim pass.
        fast_continue: a hint for dispatch loops that another pass may follow at once when this
            one filled the lane (carried for the Rust ``TaskClaimStore``'s API; the algorithm
            ignores it).
        lock_key: the name of the lane's lock (the SQL lock row, the Redis hash tag); empty
            means ``str(lane)``. See :attr:`lane_key`.

    Raises:
        InvalidValueError: on construction, when a field is out of range or of the wrong type.
    """

    lane: Lane
    kinds: tuple[Kind, ...]
    limit: int
    fast_continue: bool = False
    lock_key: str = ""

    def __post_init__(self) -> None:
        kinds: object = self.kinds
        if isinstance(kinds, (str, bytes)) or not isinstance(kinds, (tuple, list)):
            raise InvalidValueError(f"lane kinds must be a tuple of kinds, got {kinds!r}")
        # A list is accepted for convenience but stored as a tuple so the config stays hashable.
        object.__setattr__(self, "kinds", tuple(kinds))
        if not self.kinds:
            raise InvalidValueError(f"lane {self.lane!r} has no kinds")
        try:
            distinct = len(set(self.kinds))
        except TypeError as exc:
            raise InvalidValueError(f"lane {self.lane!r} has an unhashable kind") from exc
        if distinct != len(self.kinds):
            raise InvalidValueError(f"lane {self.lane!r} lists a kind twice: {self.kinds!r}")
        require_int(
            f"lane {self.lane!r} limit", self.limit, MAX_LANE_LIMIT, error=InvalidValueError
        )
        if not isinstance(self.fast_continue, bool):
            raise InvalidValueError(f"lane {self.lane!r} fast_continue must be a bool")
        if not isinstance(self.lock_key, str):
            raise InvalidValueError(f"lane {self.lane!r} lock_key must be a str")
        try:
            hash(self.lane)
        except TypeError as exc:
            raise InvalidValueError(f"lane must be hashable, got {self.lane!r}") from exc

    @property
    def lane_key(self) -> str:
        """The lane's name in storage: ``lock_key`` when set, else ``str(lane)``."""
        return self.lock_key or str(self.lane)


@dataclass(frozen=True)
class TaskClaimCandidate:
    """One listed task the algorithm asks a store to claim.

    Attributes:
        index: the task's position in the listing the candidates were built from.
        task_id: the task to claim.
        expected_processing_token: the token the task must still have (compare-and-swap).
        next_processing_token: the token the task gets when claimed.
    """

    index: int
    task_id: int
    expected_processing_token: int
    next_processing_token: int


@dataclass(frozen=True)
class ClaimedTask:
    """A candidate the store claimed.

    Attributes:
        index: the candidate's ``index`` (its position in the listing).
        task_id: the claimed task.
        processing_token: the task's new token, which names this processing attempt.
    """

    index: int
    task_id: int
    processing_token: int


@dataclass(frozen=True)
class TaskLease:
    """Proof of one processing attempt: complete, retry and heartbeat must present it.

    Attributes:
        task_id: the claimed task.
        processing_token: the token the claim set; a later claim of the task sets a larger one.
    """

    task_id: int
    processing_token: int


@runtime_checkable
class ClaimableTaskRecord(Protocol):
    """What the lane algorithm reads from a listed task (the Rust ``TaskClaimStore``'s
    ``TaskRecord``)."""

    @property
    def id(self) -> int:
        """The task's id."""

    @property
    def kind(self) -> Hashable:
        """The task's kind, mapped to its lane by the caller's ``task_lane``."""

    @property
    def processing_token(self) -> int:
        """The task's current processing token."""


@dataclass(frozen=True)
class TaskRecord(Generic[Kind]):
    """A task as the shipped stores keep it.

    Attributes:
        id: the task's id (``0 <= id <= MAX_TASK_ID``), unique in the store.
        kind: the task's kind; it decides the task's lane.
        status: pending, retry, processing or done.
        processing_token: incremented by every claim; ``0`` for a task never claimed.
        next_run_at: when a pending or retry task becomes due (tz-aware UTC).
        lease_expires_at: when the current claim's lease expires; ``None`` if never claimed.
        claimed_at: when the task was last claimed; ``None`` if never claimed.
        payload: opaque text the producer attached (the store never reads it).
    """

    id: int
    kind: Kind
    status: TaskStatus
    processing_token: int
    next_run_at: datetime
    lease_expires_at: datetime | None = None
    claimed_at: datetime | None = None
    payload: str = field(default="", repr=False)

    def is_claimable(self, at: datetime) -> bool:
        """Whether a claim at ``at`` may take the task.

        Pending and retry tasks are claimable once due; a processing task once its lease has
        expired (its holder is presumed dead).
        """
        if self.status in (TaskStatus.PENDING, TaskStatus.RETRY):
            return self.next_run_at <= at
        if self.status is TaskStatus.PROCESSING:
            return self.lease_expires_at is None or self.lease_expires_at <= at
        return False

    def is_active(self, at: datetime) -> bool:
        """Whether the task holds one of its lane's slots at ``at`` (a live lease)."""
        return (
            self.status is TaskStatus.PROCESSING
            and self.lease_expires_at is not None
            and self.lease_expires_at > at
        )

    def due_at(self) -> datetime:
        """The time the listing orders by: the lease expiry of a processing task, else
        ``next_run_at``."""
        if self.status is TaskStatus.PROCESSING and self.lease_expires_at is not None:
            return self.lease_expires_at
        return self.next_run_at


class StoreStatus(enum.IntEnum):
    """Outcome codes of the store operations that act on one task.

    The Redis scripts return them, and the memory and SQL stores compute the same codes, so
    :func:`raise_for_status` is the one place that turns an outcome into a result or an error.
    """

    OK = 0
    #: ``complete`` found the task already done by this very attempt: nothing to do.
    ALREADY_DONE = 1
    #: no task has this id (in this lane).
    NOT_FOUND = 2
    #: ``enqueue`` found a task with this id.
    EXISTS = 3
    #: the task's token is not the caller's: another attempt claimed it since.
    TOKEN_MISMATCH = 4
    #: the token matches but the task is no longer processing (retried or completed).
    NOT_PROCESSING = 5


def settle_status(
    task: TaskRecord[Any] | None, processing_token: int, *, completing: bool = False
) -> StoreStatus:
    """The outcome of ``complete``/``retry``/``heartbeat`` for the attempt ``processing_token``.

    Every store decides in this order (the Redis scripts spell the same checks in Lua).
    """
    if task is None:
        return StoreStatus.NOT_FOUND
    if task.processing_token != processing_token:
        return StoreStatus.TOKEN_MISMATCH
    if completing and task.status is TaskStatus.DONE:
        # The same attempt completing twice (Celery's failure path can fire twice) is a no-op.
        return StoreStatus.ALREADY_DONE
    if task.status is not TaskStatus.PROCESSING:
        return StoreStatus.NOT_PROCESSING
    return StoreStatus.OK


def raise_for_status(
    status: int,
    *,
    task_id: int,
    processing_token: int | None = None,
    lane: Hashable | None = None,
) -> bool:
    """Map a store outcome code to a result or an error.

    Args:
        status: a :class:`StoreStatus` value (an ``int`` as a script returns it).
        task_id: the task the operation acted on.
        processing_token: the token the caller presented, if any.
        lane: the lane a claim was for, if the operation was a claim.

    Returns:
        ``True`` when the operation changed the task, ``False`` when it found nothing to do.

    Raises:
        TaskNotFound: the task does not exist (in the claim's lane).
        InvalidValueError: the task already exists, or the code is unknown.
        LeaseLost: the caller's attempt no longer holds the task.
    """
    token = -1 if processing_token is None else processing_token
    if status == StoreStatus.OK:
        return True
    if status == StoreStatus.ALREADY_DONE:
        return False
    if status == StoreStatus.NOT_FOUND:
        raise TaskNotFound(task_id, lane)
    if status == StoreStatus.EXISTS:
        raise InvalidValueError(f"task {task_id} already exists")
    if status == StoreStatus.TOKEN_MISMATCH:
        raise LeaseLost(
            task_id, token, f"task {task_id} was claimed again since token {token} was issued"
        )
    if status == StoreStatus.NOT_PROCESSING:
        raise LeaseLost(task_id, token, f"task {task_id} is no longer processing")
    raise InvalidValueError(f"unknown store status code {status!r} for task {task_id}")
