"""The generic lane-claim algorithm: :func:`claim_due_for_lane` and its asyncio twin.

This is the Rust ``TaskClaimStore``'s algorithm, kept step for step; a store only supplies the three
storage operations of :class:`~celery_claims.lanes.protocol.TaskClaimStore`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from celery_claims.errors import InvalidValueError
from celery_claims.lanes import _validate as check
from celery_claims.lanes.model import (
    MAX_PROCESSING_TOKEN,
    ClaimableTaskRecord,
    ClaimedTask,
    Lane,
    TaskClaimCandidate,
    TaskLaneConfig,
    TaskLease,
)
from celery_claims.lanes.protocol import AsyncTaskClaimStore, TaskClaimStore

__all__ = [
    "MAX_STALE_SECS",
    "Clock",
    "aclaim_due_for_lane",
    "available_capacity",
    "claim_due_for_lane",
    "utc_now",
]

logger = logging.getLogger(__name__)

#: A clock returns the current time as a timezone-aware datetime.
Clock = Callable[[], datetime]

#: The longest processing stale period accepted, in seconds (about 68 years): far beyond any
#: sane lease, small enough that ``now - stale`` never leaves ``datetime``'s range.
MAX_STALE_SECS = 2**31 - 1

#: The message of the Rust ``TaskClaimStore``'s overflow error, kept verbatim.
TOKEN_OVERFLOW_MESSAGE = "background task processing token overflow"

TaskT = TypeVar("TaskT", bound=ClaimableTaskRecord)


def utc_now() -> datetime:
    """The default clock: the current UTC time (``freezegun`` moves it)."""
    return datetime.now(timezone.utc)


def available_capacity(limit: int, active: int) -> int:
    """How many more tasks a lane may start: ``max(limit - active, 0)``.

    Args:
        limit: the lane's limit.
        active: the lane's tasks holding a live lease now (may exceed ``limit`` after the
            limit was lowered).

    Returns:
        The free slots, never negative.
    """
    return max(limit - active, 0)


def _read_clock(clock: Clock) -> datetime:
    return check.utc("clock()", clock())


def _stale_period(processing_stale_secs: object) -> timedelta:
    secs = check.non_negative_int("processing_stale_secs", processing_stale_secs, MAX_STALE_SECS)
    # A stale period of 0 would hand out leases that expire as they are granted.
    return timedelta(seconds=max(secs, 1))


def _check_arguments(
    lane_config: object, processing_stale_secs: object, task_lane: object, clock: object
) -> timedelta:
    check.lane_config(lane_config)
    stale = _stale_period(processing_stale_secs)
    if not callable(task_lane):
        raise InvalidValueError(f"task_lane must be callable, got {task_lane!r}")
    if not callable(clock):
        raise InvalidValueError(f"clock must be callable, got {clock!r}")
    return stale


def _candidates(
    due: Sequence[TaskT], lane_config: TaskLaneConfig[Any, Lane], task_lane: Callable[[Any], Lane]
) -> list[TaskClaimCandidate]:
    candidates: list[TaskClaimCandidate] = []
    for index, task in enumerate(due):
        if not isinstance(task, ClaimableTaskRecord):
            raise InvalidValueError(f"listed task has no id, kind or processing_token: {task!r}")
        task_lane_value = task_lane(task.kind)
        if task_lane_value != lane_config.lane:
            logger.warning(
                "skipping task %s of kind %r: it belongs to lane %r, not lane %r",
                task.id,
                task.kind,
                task_lane_value,
                lane_config.lane,
            )
            continue
        processing_token = check.token(task.processing_token, "listed task processing_token")
        if processing_token == MAX_PROCESSING_TOKEN:
            # Raised before anything is claimed: one poisoned task stops the whole pass.
            raise InvalidValueError(TOKEN_OVERFLOW_MESSAGE)
        candidates.append(
            TaskClaimCandidate(
                index=index,
                task_id=check.task_id(task.id, "listed task id"),
                expected_processing_token=processing_token,
                next_processing_token=processing_token + 1,
            )
        )
    return candidates


def _leases(due: Sequence[TaskT], claimed: Sequence[ClaimedTask]) -> list[tuple[TaskT, TaskLease]]:
    result: list[tuple[TaskT, TaskLease]] = []
    for item in claimed:
        if not 0 <= item.index < len(due) or due[item.index].id != item.task_id:
            raise InvalidValueError(f"store returned a claim that matches no candidate: {item!r}")
        result.append((due[item.index], TaskLease(item.task_id, item.processing_token)))
    return result


#: One store call of the algorithm, applied to the store by the sync or the asyncio driver.
_Call = Callable[[Any], Any]


def _algorithm(
    lane_config: TaskLaneConfig[Any, Lane],
    processing_stale_secs: object,
    task_lane: Callable[[Any], Lane],
    clock: Clock,
) -> Generator[_Call, Any, list[tuple[Any, TaskLease]]]:
    """The Rust ``TaskClaimStore``'s algorithm, written once for both drivers: it yields each
    store call and is sent its result (arguments are checked before the first call)."""
    stale = _check_arguments(lane_config, processing_stale_secs, task_lane, clock)
    if lane_config.limit == 0:
        return []
    kinds, limit = lane_config.kinds, lane_config.limit
    now = _read_clock(clock)
    stale_before = now - stale
    due = yield lambda store: store.list_claimable_by_kinds(now, stale_before, kinds, limit)
    if not due:
        return []
    active = yield lambda store: store.count_active_processing_by_kinds(now, kinds)
    if available_capacity(limit, active) == 0:
        return []
    candidates = _candidates(due, lane_config, task_lane)
    if not candidates:
        # the Rust ``TaskClaimStore`` returns here: every listed task was another lane's
        return []
    claimed_at = _read_clock(clock)
    lease_expires_at = claimed_at + stale
    claimed = yield lambda store: store.claim_candidates_for_lane(
        lane_config, candidates, stale_before, claimed_at, lease_expires_at
    )
    return _leases(due, claimed)


def claim_due_for_lane(
    store: TaskClaimStore[TaskT, Any, Lane],
    lane_config: TaskLaneConfig[Any, Lane],
    processing_stale_secs: int,
    task_lane: Callable[[Any], Lane],
    *,
    clock: Clock = utc_now,
) -> list[tuple[TaskT, TaskLease]]:
    """Claim the due tasks of one lane, up to the lane's free capacity.

    The Rust ``TaskClaimStore``'s algorithm: a lane with limit 0 claims nothing without calling the
    store; otherwise list claimable tasks (at most ``limit``), count the active ones, and hand every
    listed task of this lane to the store as a candidate; the store claims as many as the lane
    still has room for when it claims. When no listed task is this lane's, it returns before
    the second clock read and never asks the store to claim.

    Args:
        store: the product store.
        lane_config: the lane to claim for.
        processing_stale_secs: how long a claim's lease lasts; a processing task whose lease
            has expired is claimable again. ``0`` counts as 1 second.
        task_lane: maps a task's kind to its lane; listed tasks of another lane are skipped
            with a warning.
        clock: the time source, read twice: once for the listing (``now``) and once more right
            before the claim (``claimed_at``).

    Returns:
        ``(task, lease)`` for every claimed task, in the order the store claimed them; ``task``
        is the record as listed, before the claim.

    Raises:
        InvalidValueError: on a bad argument, or when a listed task's processing token is
            ``2**63 - 1`` ("background task processing token overflow"); nothing is claimed.
        TaskCoreError: whatever the store raises.
    """
    steps = _algorithm(lane_config, processing_stale_secs, task_lane, clock)
    reply: Any = None
    try:
        while True:
            reply = steps.send(reply)(store)
    except StopIteration as done:
        claimed: list[tuple[TaskT, TaskLease]] = done.value
        return claimed


async def aclaim_due_for_lane(
    store: AsyncTaskClaimStore[TaskT, Any, Lane],
    lane_config: TaskLaneConfig[Any, Lane],
    processing_stale_secs: int,
    task_lane: Callable[[Any], Lane],
    *,
    clock: Clock = utc_now,
) -> list[tuple[TaskT, TaskLease]]:
    """The asyncio twin of :func:`claim_due_for_lane`, over an :class:`AsyncTaskClaimStore`.

    Same arguments, result and errors; every store call is awaited.
    """
    steps = _algorithm(lane_config, processing_stale_secs, task_lane, clock)
    reply: Any = None
    try:
        while True:
            reply = await steps.send(reply)(store)
    except StopIteration as done:
        claimed: list[tuple[TaskT, TaskLease]] = done.value
        return claimed
