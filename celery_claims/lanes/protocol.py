"""The storage interface of lane claiming: :class:`TaskClaimStore` and its asyncio twin.

A store owns the transactions, row locks and statuses of its product; the generic algorithm in
:mod:`celery_claims.lanes.dispatch` only drives it. These are the Rust ``TaskClaimStore``'s
``TaskClaimStore`` methods, with ``u64`` counts and limits as ``int`` and ``DateTime<Utc>`` as
timezone-aware UTC :class:`~datetime.datetime`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Protocol, TypeVar, runtime_checkable

from celery_claims.lanes.model import ClaimedTask, TaskClaimCandidate, TaskLaneConfig

__all__ = ["AsyncTaskClaimStore", "TaskClaimStore"]

Task_co = TypeVar("Task_co", covariant=True)
KindT = TypeVar("KindT")
LaneT = TypeVar("LaneT")


@runtime_checkable
class TaskClaimStore(Protocol[Task_co, KindT, LaneT]):
    """Product storage required by generic lane claiming.

    Every method may raise :class:`~celery_claims.errors.TaskCoreError` subclasses:
    ``InvalidValueError`` for bad arguments (nothing changed) and ``IoError`` when the storage
    fails.
    """

    def list_claimable_by_kinds(
        self, now: datetime, stale_before: datetime, kinds: Sequence[KindT], limit: int
    ) -> Sequence[Task_co]:
        """List due tasks that are claimable for the provided task kinds.

        Args:
            now: the time the pass judges due-ness and lease expiry at.
            stale_before: ``now`` minus the processing stale period.
            kinds: the lane's kinds.
            limit: the most tasks to return (the lane's limit).

        Returns:
            At most ``limit`` claimable tasks, most overdue first.
        """
        ...

    def count_active_processing_by_kinds(self, now: datetime, kinds: Sequence[KindT]) -> int:
        """Count the tasks of ``kinds`` that hold a live lease at ``now``."""
        ...

    def claim_candidates_for_lane(
        self,
        lane_config: TaskLaneConfig[KindT, LaneT],
        candidates: Sequence[TaskClaimCandidate],
        stale_before: datetime,
        claimed_at: datetime,
        lease_expires_at: datetime,
    ) -> Sequence[ClaimedTask]:
        """Atomically claim candidates after repeating the capacity check in storage.

        Recount the lane's active tasks at ``claimed_at``; go through ``candidates`` in order
        and claim each by compare-and-swap on (id, expected token, still claimable) until the
        lane is full. A candidate that fails the compare-and-swap is skipped and uses no
        capacity.

        Returns:
            The claimed candidates, in the order the store claimed them.
        """
        ...


@runtime_checkable
class AsyncTaskClaimStore(Protocol[Task_co, KindT, LaneT]):
    """The asyncio twin of :class:`TaskClaimStore` (the Rust ``TaskClaimStore``'s trait is
    async)."""

    async def list_claimable_by_kinds(
        self, now: datetime, stale_before: datetime, kinds: Sequence[KindT], limit: int
    ) -> Sequence[Task_co]:
        """See :meth:`TaskClaimStore.list_claimable_by_kinds`."""
        ...

    async def count_active_processing_by_kinds(self, now: datetime, kinds: Sequence[KindT]) -> int:
        """See :meth:`TaskClaimStore.count_active_processing_by_kinds`."""
        ...

    async def claim_candidates_for_lane(
        self,
        lane_config: TaskLaneConfig[KindT, LaneT],
        candidates: Sequence[TaskClaimCandidate],
        stale_before: datetime,
        claimed_at: datetime,
        lease_expires_at: datetime,
    ) -> Sequence[ClaimedTask]:
        """See :meth:`TaskClaimStore.claim_candidates_for_lane`."""
        ...
