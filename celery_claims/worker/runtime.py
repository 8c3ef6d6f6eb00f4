"""The claim state of one worker: settings, claim manager, counters, lanes, the lifecycle."""

from __future__ import annotations

import contextlib
from typing import Any

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.connection import close as close_client
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.lanes import WorkerLanes
from celery_claims.worker.delivery.lifecycle import Lifecycle
from celery_claims.worker.publish.clearing import WorkerJournal
from celery_claims.worker.publish.producer import PUBLISH_COUNTERS
from celery_claims.worker.settings import ClaimsSettings
from celery_claims.worker.signals import Counters
from celery_claims.worker.transport.sender import ScriptCaller, keep_calls
from celery_claims.worker.transport.store import new_manager

__all__ = ["ClaimsRuntime"]


class ClaimsRuntime:
    """The claim state of one worker.

    Reachable as ``worker.claims`` (the ``WorkController``) and from the consumer as
    ``consumer.controller.claims``.

    Args:
        app: the Celery app.
        settings: the validated settings.
        hostname: the worker's node name (the first part of every owner string).
        manager: a claim manager (default: from
        :func:`~celery_claims.worker.transport.store.new_manager`).
    """

    def __init__(
        self,
        app: Any,
        settings: ClaimsSettings,
        hostname: str,
        manager: RedisClaimManager | None = None,
    ) -> None:
        self.app = app
        self.settings = settings
        self.hostname = hostname
        self.manager = manager if manager is not None else new_manager(settings)
        # the main process's single calls (the completion of a body run on the loop or in a
        # pool thread, a gate's own claim, renewals) on connections kept for them, as a
        # prefork pool process's are (guard.py): a third of the client's CPU per call
        self._caller = ScriptCaller()
        keep_calls(self.manager, self._caller)
        self.counters = Counters()
        #: the worker's lanes, when ``claims_lanes`` is configured
        self.lanes: WorkerLanes | None = None
        if any(spec.limited for spec in settings.lanes):
            store = WorkerLanes.new_store(settings, self.manager.client)
            self.lanes = WorkerLanes(settings, store, self.counters)
        #: every delivered copy and its state
        self.life = Lifecycle(settings, self.manager, self.counters, self.lanes, hostname)
        #: the worker's default ``(soft, hard)`` time limits (``task_*time_limit``, or the
        #: ``celery worker`` options), set when the worker starts
        self.time_limits: tuple[float | None, float | None] = (None, None)
        #: the worker's pool, by Celery's name (``prefork``, ``threads``, ...), when known
        self.pool_name = ""
        #: this process's producer counters (``journal_written``, ``journal_write_failed``)
        self.publish_counters = PUBLISH_COUNTERS
        #: the publish journal's clearing and recovery (``claims_journal``)
        self.journal: WorkerJournal | None = None
        if settings.journal:
            self.journal = WorkerJournal(app, settings, self.manager, self.counters, hostname)
            self.life.on_gone = self.journal.settled
            self.life.w.keep_message = self.journal.keep
            self.life.w.held_call = self.journal.store.held_call

    def live_claims(self) -> list[Copy]:
        """The copies whose claims are renewed right now."""
        return self.life.reg.renewed()

    def held_copies(self) -> list[Copy]:
        """The copies held unacked right now."""
        return self.life.reg.held()

    def close(self) -> None:
        """Close the claim store connections (a later call would simply reconnect); the
        journal's pending clears are written first."""
        if self.journal is not None:
            self.journal.close()
        self._caller.close()
        with contextlib.suppress(Exception):
            close_client(self.manager.client)
