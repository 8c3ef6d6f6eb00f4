"""Journal recovery: a journaled message that is neither done nor claimed in time is published
again (see :mod:`celery_claims.worker.publish`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery.utils.log import get_logger

from celery_claims.claims.journal import JournalEntry, RedisJournal
from celery_claims.claims.redis import RedisClaimManager
from celery_claims.errors import ClaimError
from celery_claims.model import AlreadyDone, GivenUp
from celery_claims.runs import earlier_run, owner_run
from celery_claims.worker.publish.envelope import Envelope
from celery_claims.worker.publish.runs import run_of
from celery_claims.worker.settings import ClaimsSettings
from celery_claims.worker.signals import Counters

__all__ = ["SCAN_BATCH", "JournalRecovery"]

logger = get_logger("celery_claims.worker")

#: Most journaled messages one recovery pass takes per queue.
SCAN_BATCH = 100


class JournalRecovery:
    """Recovers the journal of some queues: each due entry dropped, put off or re-published.

    Args:
        app: the Celery app (its producer pool re-publishes).
        settings: the settings (recover delay, most re-publishes, prefix).
        manager: the claim manager (completion records and live claims are read with it).
        counters: where ``journal_republished``, ``journal_dropped``, ``journal_cleared`` and
            ``journal_deferred`` are counted.
        owner: the scan lock's owner (the worker's name).
    """

    def __init__(
        self,
        app: Any,
        settings: ClaimsSettings,
        manager: RedisClaimManager,
        counters: Counters,
        owner: str,
    ) -> None:
        self.app = app
        self.settings = settings
        self.manager = manager
        self.counters = counters
        self.owner = owner
        self.store = RedisJournal(client=manager.client, prefix=settings.prefix)

    def scan(self, queues: Iterable[str], *, lock: bool = True) -> int:
        """Recover each queue whose scan lock this worker gets; returns messages re-published.

        A store that cannot be reached ends the pass (the next one tries again).
        """
        republished = 0
        for queue_id in queues:
            try:
                if lock and not self.store.lock(
                    queue_id, self.owner, self.settings.journal_scan_interval_ms
                ):
                    continue
                republished += self.recover(queue_id)
            except ClaimError as exc:
                logger.warning("Journal: could not recover queue %s now: %s", queue_id, exc)
                break
        return republished

    def recover(self, queue_id: str) -> int:
        """One pass over ``queue_id``'s due entries (at most :data:`SCAN_BATCH`).

        Raises:
            BackendUnavailable: the store could not be reached.
        """
        entries = self.store.take_due(
            queue_id, limit=SCAN_BATCH, defer_ms=self.settings.journal_recover_after_ms
        )
        settled: list[str] = []
        republished = 0
        for entry in entries:
            outcome = self._recover_one(entry)
            if outcome == "republished":
                republished += 1
            elif outcome != "deferred":
                settled.append(entry.task_id)
        self.store.forget(queue_id, settled)
        return republished

    def _recover_one(self, entry: JournalEntry) -> str:
        queue_id, task_key = entry.queue_id, entry.task_id
        record = self.manager.done_record(queue_id, task_key)
        if record is not None and not self._later_run(entry, record):
            # done or given up: nothing to recover (the entry's clear was lost, or is coming)
            self.counters.incr("journal_cleared")
            return "done"
        if self.manager.is_claimed(queue_id, task_key) is not None:
            # a live copy holds it; its take pushed the entry one recover delay forward
            self.counters.incr("journal_deferred")
            return "deferred"
        try:
            envelope = Envelope.loads(entry.message)
        except ValueError as exc:
            self.counters.incr("journal_dropped")
            logger.warning("Journal: dropped %s/%s: %s", queue_id, task_key, exc)
            return "dropped"
        what = f"{envelope.task}[{envelope.task_id}] (claim {queue_id}/{task_key})"
        if envelope.expired(entry.now_ms):
            self.counters.incr("journal_dropped")
            logger.info("Journal: dropped %s: it expired before it ran", what)
            return "dropped"
        if entry.republished >= self.settings.journal_max_republish:
            self.counters.incr("journal_dropped")
            logger.warning(
                "Journal: gave up %s after %d re-publishes (claims_journal_max_republish): no "
                "worker has run or acked any copy of it (revoked, or no worker consumes it?)",
                what,
                entry.republished,
            )
            return "dropped"
        try:
            self.publish(envelope)
        except Exception as exc:
            logger.warning("Journal: could not re-publish %s: %r; retried later", what, exc)
            return "deferred"
        count = self.store.count_republished(queue_id, task_key)
        self.counters.incr("journal_republished")
        logger.warning(
            "Journal: re-published %s (%d of at most %d): neither done nor claimed %.0f s "
            "after its publish (or ETA, or last re-publish); lost between the broker and a "
            "worker, or still waiting in the queue (then this copy is a duplicate the claim "
            "gate skips or holds)",
            what,
            count,
            self.settings.journal_max_republish,
            self.settings.journal_recover_after_ms / 1000,
        )
        return "republished"

    @staticmethod
    def _later_run(entry: JournalEntry, record: AlreadyDone | GivenUp) -> bool:
        """True when ``entry``'s message is a later run of a canvas part than the one whose
        completion ``record`` is (a re-applied canvas: publish/runs.py): not done yet."""
        if not isinstance(record, AlreadyDone) or owner_run(record.owner) is None:
            return False  # a plain task's record, or a given-up one: the message is not read
        try:
            headers = Envelope.loads(entry.message).headers
        except ValueError:
            return False  # unreadable: the record decides, as before
        return earlier_run(record.owner, run_of(headers))

    def publish(self, envelope: Envelope) -> None:
        """Publish ``envelope``'s message again, as it was (same id, headers and body)."""
        with self.app.producer_or_acquire() as producer:
            producer.publish(
                envelope.body,
                exchange=envelope.exchange,
                routing_key=envelope.routing_key,
                headers=dict(envelope.headers),
                content_type=envelope.content_type,
                content_encoding=envelope.content_encoding,
                delivery_mode=self.app.conf.task_default_delivery_mode,
                retry=True,
                retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5},
                **dict(envelope.properties),
            )
