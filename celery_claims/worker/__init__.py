"""The Celery integration: ``install(app)``, the claim gate, the lease keeper, signals.

Only this subpackage imports Celery; the claim core does not.
"""

from celery_claims.worker.consumer import ClaimsConsumerMixin
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.guard import ClaimUnverified, StaleCopy, current_claim
from celery_claims.worker.delivery.state import State
from celery_claims.worker.history import connect_history, history_connected
from celery_claims.worker.install import install
from celery_claims.worker.runtime import ClaimsRuntime
from celery_claims.worker.settings import ClaimsSettings, LaneSpec, load_settings
from celery_claims.worker.signals import (
    Counters,
    claim_acquired,
    claim_released,
    lane_slot,
    lease_lost,
    task_held,
    task_skipped,
)
from celery_claims.worker.tasks import CLEANUP_TASK_NAME

__all__ = [
    # installation
    "install",
    "ClaimsConsumerMixin",
    "connect_history",
    "history_connected",
    # settings
    "ClaimsSettings",
    "LaneSpec",
    "load_settings",
    # task code
    "ClaimUnverified",
    "StaleCopy",
    "current_claim",
    # run-time state
    "ClaimsRuntime",
    "Copy",
    "State",
    "Counters",
    # signals
    "claim_acquired",
    "claim_released",
    "lane_slot",
    "lease_lost",
    "task_held",
    "task_skipped",
    # names
    "CLEANUP_TASK_NAME",
]
