"""``install(app)``: make a Celery app claim-aware, no Task base class needed."""

from __future__ import annotations

from typing import Any

from celery_claims.observe import connect_journal, journal_connected
from celery_claims.worker.guard import declare_request_key
from celery_claims.worker.settings import add_worker_options
from celery_claims.worker.steps import Gate, LeaseKeeper, Sweep
from celery_claims.worker.tasks import connect_schedule, register_cleanup_task

__all__ = ["install"]

#: Attribute set on an app once ``install`` has run, so a second call changes nothing.
_INSTALLED = "_celery_claims_installed"


def install(app: Any) -> Any:
    """Make every worker of ``app`` claim each task before running it.

    Adds the lease keeper (worker bootstep), the claim gate and, for pools without an event
    loop, the Redis broker's restore sweep (consumer bootsteps), the
    ``--claims-*`` worker options, the ``celery_claims.cleanup_expired`` task and its beat
    entry, and connects the journal of skipped copies
    (:func:`celery_claims.observe.connect_journal`, which writes only for copies that are
    skipped, held by another worker or taken over). Idempotent. Settings are read and
    validated when a worker starts, so ``install`` can run before the app is configured.

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
    app.steps["consumer"].add(Gate)
    app.steps["consumer"].add(Sweep)
    add_worker_options(app)
    register_cleanup_task(app)
    if not journal_connected():
        # keep options a user set with an earlier connect_journal(...) call
        connect_journal()
    setattr(app, _INSTALLED, True)
    return app
