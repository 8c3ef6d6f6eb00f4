"""Which tasks the gate claims, and the per-task claim attributes, checked at worker start."""

from __future__ import annotations

from typing import Any

from celery_claims.errors import InvalidArgument
from celery_claims.worker.settings import ClaimsSettings

__all__ = ["EXEMPT_PREFIXES", "check_task_policies", "is_exempt"]

#: Task name prefixes the gate never claims: Celery's own tasks and this package's.
EXEMPT_PREFIXES = ("celery.", "celery_claims.")


def is_exempt(task: Any, name: str) -> bool:
    """True if the gate lets ``task`` through unclaimed (Celery's tasks, ours, opt-outs)."""
    if name.startswith(EXEMPT_PREFIXES):
        return True
    return getattr(task, "claims", True) is False


def check_task_policies(app: Any, settings: ClaimsSettings) -> None:
    """Validate the per-task ``claims`` and ``claims_lease_ms`` attributes of every task.

    Raises:
        InvalidArgument: an attribute has the wrong type or an unusable value.
    """
    for name, task in sorted(app.tasks.items()):
        flag = getattr(task, "claims", True)
        if not isinstance(flag, bool):
            raise InvalidArgument(f"{name}.claims", f"must be True or False, got {flag!r:.80}")
        lease = getattr(task, "claims_lease_ms", None)
        if lease is not None:
            settings.check_task_lease(name, lease)
