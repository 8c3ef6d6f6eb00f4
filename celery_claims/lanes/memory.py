"""The in-memory lane store: the executable specification of a :class:`TaskClaimStore`.

Every other store must behave like this one (the contract suite checks it). It is public so
users can test their dispatch loops without Redis or a database. Thread-safe: one lock guards
all tasks, so each operation is atomic, as a store's transaction or script is.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Generic

from celery_claims.lanes import _validate as check
from celery_claims.lanes.dispatch import Clock, available_capacity, utc_now
from celery_claims.lanes.model import (
    ClaimedTask,
    Kind,
    Lane,
    StoreStatus,
    TaskClaimCandidate,
    TaskLaneConfig,
    TaskRecord,
    TaskStatus,
    raise_for_status,
    settle_status,
)

__all__ = ["MemoryTaskClaimStore"]


class MemoryTaskClaimStore(Generic[Kind, Lane]):
    """A lane store in a dict, for tests and single-process use.

    Args:
        lanes: the lanes the store serves; every task's kind must belong to one of them.
        clock: the time source of ``enqueue``'s default ``next_run_at``.

    Raises:
        InvalidValueError: when two lanes share a kind or a lane key.
    """

    def __init__(
        self, *, lanes: Iterable[TaskLaneConfig[Kind, Lane]], clock: Clock = utc_now
    ) -> None:
        self._lanes: check.LaneRegistry[Kind, Lane] = check.LaneRegistry(lanes, str_kinds=False)
        self._clock = clock
        self._tasks: dict[int, TaskRecord[Kind]] = {}
        self._lock = threading.Lock()

    # --- producer and worker operations ---------------------------------------------------

    def enqueue(
        self,
        task_id: int,
        kind: Kind,
        *,
        next_run_at: datetime | None = None,
        payload: str = "",
    ) -> TaskRecord[Kind]:
        """Add a pending task.

        Args:
            task_id: the new task's id, unique in the store.
            kind: the task's kind; it must belong to one of the store's lanes.
            next_run_at: when the task becomes due; ``None`` means now.
            payload: opaque text for the worker.

        Returns:
            The stored task (status pending, token 0).

        Raises:
            InvalidValueError: on a bad argument or when the id is taken.
        """
        _, task = self._lanes.new_task(task_id, kind, next_run_at, payload, self._clock)
        with self._lock:
            if task_id in self._tasks:
                raise_for_status(StoreStatus.EXISTS, task_id=task_id)
            self._tasks[task_id] = task
        return task

    def get_task(self, task_id: int) -> TaskRecord[Kind] | None:
        """The task with this id, or ``None``."""
        check.task_id(task_id)
        with self._lock:
            return self._tasks.get(task_id)

    def complete(self, task_id: int, processing_token: int) -> bool:
        """Record that the attempt ``processing_token`` finished the task.

        Returns:
            ``True`` if the task became done, ``False`` if this attempt had already completed
            it (completing twice is harmless).

        Raises:
            InvalidValueError: on a bad argument or an unknown id.
            LeaseLost: another attempt holds the task, or it is no longer processing.
        """
        check.attempt(task_id, processing_token)
        return self._settle(task_id, processing_token, {"status": TaskStatus.DONE}, completing=True)

    def retry(self, task_id: int, processing_token: int, *, next_run_at: datetime) -> None:
        """Give the task back for another attempt at ``next_run_at`` (status retry).

        Raises:
            InvalidValueError: on a bad argument or an unknown id.
            LeaseLost: another attempt holds the task, or it is no longer processing.
        """
        check.attempt(task_id, processing_token)
        due = check.utc("next_run_at", next_run_at)
        changes = {"status": TaskStatus.RETRY, "next_run_at": due, "lease_expires_at": None}
        self._settle(task_id, processing_token, changes)

    def heartbeat(self, task_id: int, processing_token: int, *, lease_expires_at: datetime) -> None:
        """Renew the lease of the attempt ``processing_token`` until ``lease_expires_at``.

        A lease that has expired may still be renewed as long as no other attempt claimed the
        task (its token is unchanged).

        Raises:
            InvalidValueError: on a bad argument or an unknown id.
            LeaseLost: another attempt holds the task, or it is no longer processing.
        """
        check.attempt(task_id, processing_token)
        lease = check.utc("lease_expires_at", lease_expires_at)
        self._settle(task_id, processing_token, {"lease_expires_at": lease})

    def _settle(
        self, task_id: int, token: int, changes: dict[str, Any], *, completing: bool = False
    ) -> bool:
        """Apply ``changes`` to the attempt's task if it still holds it, or report why not."""
        with self._lock:
            task = self._tasks.get(task_id)
            status = settle_status(task, token, completing=completing)
            if status is StoreStatus.OK and task is not None:
                self._tasks[task_id] = dataclasses.replace(task, **changes)
        return raise_for_status(status, task_id=task_id, processing_token=token)

    def count_unfinished(self, kinds: Sequence[Kind]) -> int:
        """How many tasks of ``kinds`` are pending, retry or processing."""
        wanted = set(self._lanes.check_kinds(kinds))
        with self._lock:
            return sum(
                1
                for task in self._tasks.values()
                if task.kind in wanted and task.status is not TaskStatus.DONE
            )

    def snapshot(self) -> tuple[TaskRecord[Kind], ...]:
        """Every task, ordered by id (for tests that compare a store's state)."""
        with self._lock:
            return tuple(self._tasks[task_id] for task_id in sorted(self._tasks))

    # --- TaskClaimStore ---------------------------------------------------------------------

    def list_claimable_by_kinds(
        self, now: datetime, stale_before: datetime, kinds: Sequence[Kind], limit: int
    ) -> list[TaskRecord[Kind]]:
        """List at most ``limit`` tasks of ``kinds`` claimable at ``now``.

        Ordered by when they became claimable (``next_run_at``, or the expiry of a processing
        task's lease), then by id.
        """
        at, _ = check.listing_times(now, stale_before)
        wanted = set(self._lanes.check_kinds(kinds))
        count = check.non_negative_int("limit", limit)
        with self._lock:
            claimable = [
                task
                for task in self._tasks.values()
                if task.kind in wanted and task.is_claimable(at)
            ]
        claimable.sort(key=lambda task: (task.due_at(), task.id))
        return claimable[:count]

    def count_active_processing_by_kinds(self, now: datetime, kinds: Sequence[Kind]) -> int:
        """Count the tasks of ``kinds`` whose lease is live at ``now``."""
        at = check.utc("now", now)
        wanted = set(self._lanes.check_kinds(kinds))
        with self._lock:
            return sum(
                1 for task in self._tasks.values() if task.kind in wanted and task.is_active(at)
            )

    def claim_candidates_for_lane(
        self,
        lane_config: TaskLaneConfig[Kind, Lane],
        candidates: Sequence[TaskClaimCandidate],
        stale_before: datetime,
        claimed_at: datetime,
        lease_expires_at: datetime,
    ) -> list[ClaimedTask]:
        """Claim candidates in order until the lane is full, each by compare-and-swap.

        Raises:
            InvalidValueError: on a bad argument, a lane this store does not serve, or a
                candidate that is not a task of the lane; nothing is claimed.
        """
        lane = self._lanes.registered(lane_config)
        checked = check.candidates(candidates)
        _, at, lease = check.claim_window(stale_before, claimed_at, lease_expires_at)
        kinds = set(lane.kinds)
        with self._lock:
            # Every candidate is checked before the first claim: a bad batch changes nothing.
            for candidate in checked:
                task = self._tasks.get(candidate.task_id)
                if task is None or task.kind not in kinds:
                    raise_for_status(
                        StoreStatus.NOT_FOUND, task_id=candidate.task_id, lane=lane.lane
                    )
            active = sum(
                1 for task in self._tasks.values() if task.kind in kinds and task.is_active(at)
            )
            available = available_capacity(lane_config.limit, active)
            claimed: list[ClaimedTask] = []
            for candidate in checked:
                if len(claimed) >= available:
                    break
                task = self._tasks[candidate.task_id]
                if (
                    task.processing_token != candidate.expected_processing_token
                    or not task.is_claimable(at)
                ):
                    continue
                self._tasks[task.id] = dataclasses.replace(
                    task,
                    status=TaskStatus.PROCESSING,
                    processing_token=candidate.next_processing_token,
                    lease_expires_at=lease,
                    claimed_at=at,
                )
                claimed.append(
                    ClaimedTask(candidate.index, task.id, candidate.next_processing_token)
                )
        return claimed
