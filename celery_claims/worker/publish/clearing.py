"""The worker's side of the publish journal: the entries of messages gone for good are cleared,
and each queue it consumes is recovered in turn (see :mod:`celery_claims.worker.publish`)."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

from celery.signals import task_revoked
from celery.utils.log import get_logger

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.errors import ClaimError
from celery_claims.worker.identity import QueueResolver, attempt_of, claim_task_id
from celery_claims.worker.policy import is_exempt
from celery_claims.worker.publish.envelope import Envelope
from celery_claims.worker.publish.producer import PRODUCER_TIMEOUT_MS
from celery_claims.worker.publish.recovery import JournalRecovery
from celery_claims.worker.settings import ClaimsSettings
from celery_claims.worker.signals import Counters
from celery_claims.worker.transport.sender import ScriptSender

__all__ = ["MAX_PENDING_CLEARS", "WorkerJournal"]

logger = get_logger("celery_claims.worker")

#: Clears a worker keeps while the store cannot take them (beyond that they are let go: a
#: stale entry is found done by recovery anyway).
MAX_PENDING_CLEARS = 100_000


class WorkerJournal:
    """A worker's side of the journal: clears the entries of acked messages, recovers the
    rest (see the module docstring). Driven by the lease keeper (:meth:`beat`).

    Args:
        app: the Celery app.
        settings: the worker's settings.
        manager: the worker's claim manager.
        counters: the worker's counters.
        hostname: the worker's name (the scan lock's owner).
    """

    def __init__(
        self,
        app: Any,
        settings: ClaimsSettings,
        manager: RedisClaimManager,
        counters: Counters,
        hostname: str,
    ) -> None:
        self.app = app
        self.settings = settings
        self.counters = counters
        self.recovery = JournalRecovery(app, settings, manager, counters, hostname)
        self.store = self.recovery.store
        self._queues = QueueResolver(app)
        self._lock = threading.Lock()
        self._pending: dict[str, set[str]] = {}
        #: the keys in ``_pending``, counted as they are noted (not summed per message)
        self._pending_count = 0
        self._next_scan = 0.0
        self._scanner: threading.Thread | None = None
        self._sender = ScriptSender()
        # weak: the receiver goes with this object (in-process test workers come and go)
        task_revoked.connect(self._on_revoked)

    # --- keeping -----------------------------------------------------------------------------

    def keep(self, queue_id: str, task_key: str, message: Any) -> None:
        """Make sure the delivered ``message`` of this attempt has its journal entry, before
        the worker acknowledges it at claim (``claims_ack_on_claim``); one round trip, waited
        for. An entry the producer wrote stays as it is.

        Raises:
            ValueError: the message cannot be journaled (no task id, no body).
            ClaimError: the store did not take the write: the message must not be acked.
        """
        envelope = Envelope.of_delivery(message)
        self.store.put(
            queue_id,
            task_key,
            envelope.dumps(),
            recover_after_ms=self.settings.journal_recover_after_ms,
            eta_ms=envelope.eta_ms,
            keep=True,
        )

    # --- clearing --------------------------------------------------------------------------

    def settled(self, queue_id: str, task_key: str, done: bool = True) -> None:
        """The message of this attempt was acked for good: clear its entry.

        ``done``: the attempt is recorded done (or given up), so recovery would find its
        record and drop the entry anyway: cleared on the next beat, batched. Otherwise (it
        failed, was rejected or revoked, or skipped under a key's ``skip`` policy) nothing
        but the entry tells recovery the message is over, and a worker that died before its
        next beat would leave it to be published again: it is cleared now, one write sent
        without waiting for the reply (batched where the store takes no such write).
        """
        if not done and ScriptSender.usable(self.store.client):
            try:
                call = self.store.forget_call(queue_id, [task_key])
                again = functools.partial(self._cleared, queue_id, task_key)
                self._sender.send(self.store.client, call, again)
                return
            except ClaimError as exc:
                logger.debug("Journal: clear of %s/%s kept for later: %s", queue_id, task_key, exc)
        self._note(queue_id, task_key)

    def _note(self, queue_id: str, task_key: str) -> None:
        with self._lock:
            if self._pending_count < MAX_PENDING_CLEARS:
                keys = self._pending.setdefault(queue_id, set())
                if task_key not in keys:
                    keys.add(task_key)
                    self._pending_count += 1

    def _cleared(
        self, queue_id: str, task_key: str, reply: Any, error: BaseException | None
    ) -> None:
        """The reply to a clear sent without waiting: one that failed goes to the next beat."""
        if error is not None:
            logger.debug("Journal: clear of %s/%s kept for later: %s", queue_id, task_key, error)
            self._note(queue_id, task_key)

    def _on_revoked(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        """``task_revoked`` (revoked or expired, acked by Celery before any gate saw it)."""
        try:
            if getattr(sender, "app", None) is not self.app or request is None:
                return
            name = str(getattr(sender, "name", ""))
            if is_exempt(sender, name):
                return
            attempt = attempt_of(
                {
                    "retries": getattr(request, "retries", 0),
                    "replaced_task_nesting": getattr(request, "replaced_task_nesting", 0),
                }
            )
            queue_id = self._queues.queue_of(getattr(request, "delivery_info", None))
            self.settled(queue_id, claim_task_id(str(request.id), attempt), done=False)
        except Exception as exc:
            logger.debug("Journal: could not note a revoked task: %r", exc)

    def flush(self) -> None:
        """Clear the noted entries: one pipeline per queue (kept for the next beat if the
        store cannot be reached)."""
        with self._lock:
            pending, self._pending, self._pending_count = self._pending, {}, 0
        for queue_id, keys in pending.items():
            try:
                self.store.forget(queue_id, keys)
            except ClaimError as exc:
                logger.debug("Journal: clears of %s kept for later: %s", queue_id, exc)
                for key in keys:
                    self._note(queue_id, key)

    # --- the keeper's hook -----------------------------------------------------------------

    def consumed_queues(self) -> list[str]:
        """The queues this worker consumes now."""
        queues = self.app.amqp.queues
        consuming = getattr(queues, "consume_from", None) or queues
        return sorted(consuming)

    def beat(self) -> None:
        """Each keeper beat: flush the clears; start a recovery scan when one is due.

        The scan runs in a thread of its own, one at a time: a slow broker must not hold up
        the keeper's renewals.
        """
        self.flush()
        now = time.monotonic()
        if now < self._next_scan:
            return
        scanner = self._scanner
        if scanner is not None and scanner.is_alive():
            return
        self._next_scan = now + self.settings.journal_scan_interval_ms / 1000
        self._scanner = threading.Thread(
            target=self._scan, name="celery-claims-journal", daemon=True
        )
        self._scanner.start()

    def _scan(self) -> None:
        try:
            self.recovery.scan(self.consumed_queues())
        except Exception:
            logger.exception("Journal: recovery scan failed")

    def close(self) -> None:
        """Flush the clears and stop listening for revoked tasks (reentrant)."""
        self._sender.drain(PRODUCER_TIMEOUT_MS / 1000)
        self._sender.close()
        with contextlib.suppress(Exception):
            self.flush()
        task_revoked.disconnect(self._on_revoked)
