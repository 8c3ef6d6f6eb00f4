"""Lanes: fleet-wide limits on how many tasks of given kinds are processing at once.

The port of the Rust ``TaskClaimStore``: value types, the store protocol, the generic
claim algorithm, and three stores (memory, Redis, SQL). See ``docs/lanes.md``.

The SQL store lives in :mod:`celery_claims.lanes.sql` and is imported from there, so
SQLAlchemy (the ``sql`` extra) is needed only by those who use it.
"""

from celery_claims.errors import (
    CodecError,
    InvalidValueError,
    IoError,
    LeaseLost,
    LeaseRenewalTimedOut,
    TaskCoreError,
    TaskNotFound,
    WorkerShutdownRequested,
)
from celery_claims.lanes.adapters import ThreadedAsyncStore
from celery_claims.lanes.dispatch import (
    Clock,
    aclaim_due_for_lane,
    available_capacity,
    claim_due_for_lane,
    utc_now,
)
from celery_claims.lanes.memory import MemoryTaskClaimStore
from celery_claims.lanes.model import (
    MAX_PROCESSING_TOKEN,
    MAX_TASK_ID,
    ClaimableTaskRecord,
    ClaimedTask,
    StoreStatus,
    TaskClaimCandidate,
    TaskLaneConfig,
    TaskLease,
    TaskRecord,
    TaskStatus,
    raise_for_status,
)
from celery_claims.lanes.protocol import AsyncTaskClaimStore, TaskClaimStore
from celery_claims.lanes.redis import RedisTaskClaimStore

__all__ = [
    # limits
    "MAX_PROCESSING_TOKEN",
    "MAX_TASK_ID",
    # value types
    "ClaimableTaskRecord",
    "ClaimedTask",
    "TaskClaimCandidate",
    "TaskLaneConfig",
    "TaskLease",
    "TaskRecord",
    "TaskStatus",
    # store protocol and outcome codes
    "AsyncTaskClaimStore",
    "StoreStatus",
    "TaskClaimStore",
    "raise_for_status",
    # the algorithm
    "Clock",
    "aclaim_due_for_lane",
    "available_capacity",
    "claim_due_for_lane",
    "utc_now",
    # stores and adapters
    "MemoryTaskClaimStore",
    "RedisTaskClaimStore",
    "ThreadedAsyncStore",
    # errors
    "CodecError",
    "InvalidValueError",
    "IoError",
    "LeaseLost",
    "LeaseRenewalTimedOut",
    "TaskCoreError",
    "TaskNotFound",
    "WorkerShutdownRequested",
]
