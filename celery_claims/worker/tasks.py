"""The beat task ``celery_claims.cleanup_expired``, modelled on ``celery.backend_cleanup``.

Idempotent (removing an expired claim twice removes nothing the second time) and bounded per
run by ``claims_cleanup_limit``, so one run never holds the claim store for long. With
``claims_lanes`` it also purges the lane tickets of workers that are gone
(:meth:`~celery_claims.worker.delivery.lanes.WorkerLanes.purge`, at most that limit per lane). With
``claims_journal`` it also recovers the publish journal of every queue claims were ever taken
in (:class:`~celery_claims.worker.publish.recovery.JournalRecovery`, under the same per-queue lock
the workers take), so a queue whose workers are all gone still gets its lost messages back. Its
schedule entry is added on ``app.on_after_finalize`` with ``setdefault``: ``celery beat`` finalizes
the app after importing the user's module, so a ``beat_schedule`` assigned after ``install(app)``
still gets the entry, and an entry the user defines under the same name wins.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from celery_claims.config import resolve
from celery_claims.worker.delivery.lanes import WorkerLanes
from celery_claims.worker.publish.recovery import JournalRecovery
from celery_claims.worker.settings import load_settings
from celery_claims.worker.signals import Counters
from celery_claims.worker.transport.store import new_manager

__all__ = [
    "CLEANUP_TASK_NAME",
    "add_cleanup_schedule",
    "connect_schedule",
    "register_cleanup_task",
]

#: Stable name of the cleanup task and of its beat schedule entry.
CLEANUP_TASK_NAME = "celery_claims.cleanup_expired"


def register_cleanup_task(app: Any) -> Any:
    """Register ``celery_claims.cleanup_expired`` on ``app`` and return it."""

    @app.task(name=CLEANUP_TASK_NAME, shared=False, lazy=False)  # type: ignore[untyped-decorator]
    def cleanup_expired(limit: int | None = None) -> int:
        """Remove expired claims of every queue, at most ``limit`` (default: the setting),
        and as many stale lane tickets per lane; returns how many claims were removed."""
        settings = load_settings(app)
        manager = new_manager(settings)
        try:
            most = settings.cleanup_limit if limit is None else limit
            removed = manager.cleanup_expired(limit=most)
            if any(spec.limited for spec in settings.lanes):
                # the lane tickets of workers that are gone (the workers purge them too)
                store = WorkerLanes.new_store(settings, manager.client)
                WorkerLanes(settings, store, Counters()).purge(limit=most)
            if settings.journal:
                recovery = JournalRecovery(app, settings, manager, Counters(), CLEANUP_TASK_NAME)
                recovery.scan(manager.known_queues())
            return removed
        finally:
            manager.client.close()

    return cleanup_expired


def add_cleanup_schedule(app: Any) -> None:
    """Add the cleanup entry to ``app.conf.beat_schedule`` unless the user defined one.

    Its period is ``claims_cleanup_interval_s``, validated as the worker validates it.

    Raises:
        InvalidArgument: ``claims_cleanup_interval_s`` is not a positive number of seconds
            (on finalization Celery logs it and the entry is left out; the worker refuses to
            start with the same error).
    """
    key = "claims_cleanup_interval_s"
    interval_s = resolve(app.conf, keys=(key,))[key]
    schedule = app.conf.beat_schedule
    if schedule is None:
        schedule = app.conf.beat_schedule = {}
    schedule.setdefault(
        CLEANUP_TASK_NAME,
        {
            "task": CLEANUP_TASK_NAME,
            "schedule": timedelta(seconds=interval_s),
            # a run that waited longer than a period is stale: the next one does the work
            "options": {"expires": interval_s},
        },
    )


def connect_schedule(app: Any) -> None:
    """Arrange for :func:`add_cleanup_schedule` to run when ``app`` is finalized."""

    def on_after_finalize(sender: Any = None, **kwargs: Any) -> None:
        add_cleanup_schedule(app)

    if app.finalized:
        add_cleanup_schedule(app)
    else:
        # weak=False: the receiver is a closure that nothing else references
        app.on_after_finalize.connect(on_after_finalize, weak=False)
