"""Adapters between the sync and the asyncio store protocols."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime
from typing import Generic, TypeVar

from celery_claims.lanes.model import ClaimedTask, TaskClaimCandidate, TaskLaneConfig
from celery_claims.lanes.protocol import TaskClaimStore

__all__ = ["ThreadedAsyncStore"]

TaskT = TypeVar("TaskT")
KindT = TypeVar("KindT")
LaneT = TypeVar("LaneT")


class ThreadedAsyncStore(Generic[TaskT, KindT, LaneT]):
    """An :class:`~celery_claims.lanes.protocol.AsyncTaskClaimStore` over a sync store.

    Each call runs in the default executor (``asyncio.to_thread``), so a blocking store (Redis,
    SQL) does not stall the event loop. The shipped stores are thread-safe.

    Args:
        store: the sync store to wrap.
    """

    def __init__(self, store: TaskClaimStore[TaskT, KindT, LaneT]) -> None:
        self.store = store

    async def list_claimable_by_kinds(
        self, now: datetime, stale_before: datetime, kinds: Sequence[KindT], limit: int
    ) -> Sequence[TaskT]:
        """See :meth:`TaskClaimStore.list_claimable_by_kinds`."""
        return await asyncio.to_thread(
            self.store.list_claimable_by_kinds, now, stale_before, kinds, limit
        )

    async def count_active_processing_by_kinds(self, now: datetime, kinds: Sequence[KindT]) -> int:
        """See :meth:`TaskClaimStore.count_active_processing_by_kinds`."""
        return await asyncio.to_thread(self.store.count_active_processing_by_kinds, now, kinds)

    async def claim_candidates_for_lane(
        self,
        lane_config: TaskLaneConfig[KindT, LaneT],
        candidates: Sequence[TaskClaimCandidate],
        stale_before: datetime,
        claimed_at: datetime,
        lease_expires_at: datetime,
    ) -> Sequence[ClaimedTask]:
        """See :meth:`TaskClaimStore.claim_candidates_for_lane`."""
        return await asyncio.to_thread(
            self.store.claim_candidates_for_lane,
            lane_config,
            candidates,
            stale_before,
            claimed_at,
            lease_expires_at,
        )
