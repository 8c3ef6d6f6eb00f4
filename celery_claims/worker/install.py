"""``install(app)``: make a Celery app claim-aware, no Task base class needed."""

from __future__ import annotations

from typing import Any

from celery_claims.worker.delivery.guard import declare_request_key
from celery_claims.worker.history import connect_history, history_connected
from celery_claims.worker.publish.producer import connect_producer
from celery_claims.worker.publish.runs import connect_runs
from celery_claims.worker.settings import add_worker_options
from celery_claims.worker.steps import Gate, History, LeaseKeeper, Sweep
from celery_claims.worker.tasks import connect_schedule, register_cleanup_task

__all__ = ["install"]

#: Attribute set on an app once ``install`` has run, so a second call changes nothing.
_INSTALLED = "_celery_claims_installed"


def install(app: Any) -> Any:
    """Make every worker of ``app`` claim each task before running it.

    Adds the lease keeper and the task history's writer (worker bootsteps), the claim gate
    and, for pools without an event loop and on kombu before 5.7, the Redis broker's restore
    sweep (consumer bootsteps), the ``--claims-*`` worker options, the
    ``celery_claims.cleanup_expired`` task and its beat entry, and connects the task history
    of copies not run (:func:`celery_claims.worker.connect_history`: copies skipped or held,
    lane waits, takeovers, lease losses and released claims, written from a thread of its
    own).
    Idempotent. Settings are read and validated when a worker starts, so ``install`` can run
    before the app is configured. In every process of the app, producers included, each
    message it publishes is written to the claim store's publish journal
    (:mod:`celery_claims.worker.publish`; ``claims_journal``), so a message lost between the
    broker and a worker is re-published, and each message of a canvas part carries a run of
    its own (:mod:`celery_claims.worker.publish.runs`: a re-applied canvas is a new run).

    Args:
        app: the Celery app.

    Returns:
        ``app``, for chaining.

    Raises:
        InvalidArgument: ``app`` is finalized already and its ``claims_cleanup_interval_s``
            is invalid (nothing is installed).
    """
    if getattr(app, _INSTALLED, False):
        return app
    # first: on a finalized app it validates claims_cleanup_interval_s, before any change
    connect_schedule(app)
    declare_request_key()
    app.steps["worker"].add(LeaseKeeper)
    app.steps["worker"].add(History)
    app.steps["consumer"].add(Gate)
    app.steps["consumer"].add(Sweep)
    add_worker_options(app)
    register_cleanup_task(app)
    connect_producer(app)
    connect_runs()
    if not history_connected():
        # keep options a user set with an earlier connect_history(...) call
        connect_history()
    setattr(app, _INSTALLED, True)
    return app
