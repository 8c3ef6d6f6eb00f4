"""The publish journal, Celery side: producers journal what they publish, workers recover it.

Why: kombu's Redis transport takes a message off the queue with ``BRPOP`` and records the
delivery in ``unacked`` only afterwards, in a second round trip (``QoS.append``). A consumer
killed in between (SIGKILL, OOM, a paused-then-killed process, a reply lost in a broker
restart) takes the only copy with it: visibility-timeout restore cannot bring back what
``unacked`` never had. Plain Celery has the same hole (kombu #305).

- **Producer** (:class:`ProducerJournal`, set up by ``install(app)``, which runs in producer
  processes too): every message ``app.send_task`` publishes (``apply_async``, ``retry``,
  ``replace``, canvas, beat) is written to the claim store's journal of its queue, keyed by
  the attempt's claim id, with the time after which recovery may act
  (``claims_journal_recover_after_ms`` after the publish, or after the ETA). Where the claim
  store is the Redis broker's server, the publish itself carries it: kombu's push of the
  message to the queue's list and the journal entry are one script, the push first
  (:class:`~celery_claims.worker.transport.publish.PublishRide`). Elsewhere it is written once the
  broker has taken the message, without waiting for the reply: after the publish, not
  before, since a publish that raised must not be re-published behind the caller's back. A
  failed write never fails the publish: it is logged and counted (``journal_write_failed``),
  and for :data:`RETRY_AFTER_S` after it the process does not try again, so an unreachable
  store does not slow every publish.
- **Worker** (:class:`WorkerJournal`, one per worker, driven by the lease keeper's beat): the
  entry of every message the worker acks (done, skipped as done, failed, given up, rejected,
  revoked) is cleared, batched into one pipeline per queue per beat; and every
  ``claims_journal_scan_interval_ms`` it recovers the journal of each queue it consumes
  (:class:`JournalRecovery`): an entry whose recover time has passed is dropped if its task
  is recorded done (or given up), put off if a live claim holds it, and otherwise
  re-published, at most ``claims_journal_max_republish`` times.

Correctness rests on recovery's check, not on the clearing: a stale entry (its clear was lost
with a worker) is found done and dropped. A re-published copy whose original was only slow
is a duplicate the claim gate skips (done) or holds (claimed).
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from celery.signals import before_task_publish, task_revoked
from celery.utils.log import get_logger
from kombu.serialization import dumps as serialize
from kombu.utils import json

from celery_claims.claims.journal import JournalEntry, RedisJournal
from celery_claims.claims.redis import RedisClaimManager, ScriptCall, translate_errors
from celery_claims.connection import close as close_client
from celery_claims.errors import ClaimError, InvalidArgument
from celery_claims.worker.compat import close_with, wrap_send_task, wrap_task_sender
from celery_claims.worker.identity import QueueResolver, attempt_of, claim_task_id
from celery_claims.worker.policy import is_exempt
from celery_claims.worker.settings import ClaimsSettings, load_settings
from celery_claims.worker.signals import Counters
from celery_claims.worker.transport.publish import PublishRide
from celery_claims.worker.transport.sender import ScriptSender
from celery_claims.worker.transport.store import new_client

__all__ = [
    "PUBLISH_COUNTERS",
    "RETRY_AFTER_S",
    "SCAN_BATCH",
    "Envelope",
    "JournalRecovery",
    "ProducerJournal",
    "WorkerJournal",
    "connect_producer",
]

logger = get_logger("celery_claims.worker")

#: The producer counters of this process: ``journal_written``, ``journal_write_failed``.
PUBLISH_COUNTERS = Counters()
#: After a failed journal write, this process publishes unjournaled (counted as failed) for
#: this long before it tries the store again, doubled on each failure in a row.
RETRY_AFTER_S = 1.0
#: Ceiling of that pause.
RETRY_AFTER_MAX_S = 30.0
#: Longest a journal write may hold up a publish, in ms (or ``claims_socket_timeout_ms`` if
#: shorter): the publish has succeeded already, and a producer (a web request) must not wait
#: the worker's timeout on a claim store that hangs.
PRODUCER_TIMEOUT_MS = 500
#: Most journaled messages one recovery pass takes per queue.
SCAN_BATCH = 100
#: Clears a worker keeps while the store cannot take them (beyond that they are let go: a
#: stale entry is found done by recovery anyway).
MAX_PENDING_CLEARS = 100_000
#: Envelope format version.
_VERSION = 1


def _epoch_ms(value: Any) -> int | None:
    """An ETA or expiry header (ISO 8601 string or datetime) in epoch ms; None if absent."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, datetime):
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return int(value.timestamp() * 1000)


@dataclass(frozen=True)
class Envelope:
    """One published message as the journal keeps it: what a re-publish needs.

    Attributes:
        task: the task name.
        task_id: the Celery task id.
        headers: the message headers (protocol 2: ``id``, ``retries``, ``eta``...).
        body: the body, serialized with the message's own serializer.
        content_type: the serializer's content type.
        content_encoding: the serializer's content encoding.
        exchange: the exchange it was published to.
        routing_key: its routing key.
        properties: the other publish properties (``correlation_id``, ``reply_to``,
            ``priority``...).
    """

    task: str
    task_id: str
    headers: Mapping[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    exchange: str
    routing_key: str
    properties: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        *,
        body: Any,
        serializer: str,
        headers: Mapping[str, Any],
        exchange: Any,
        routing_key: Any,
        properties: Mapping[str, Any] | None,
    ) -> Envelope:
        """The envelope of a message about to be published (``before_task_publish``).

        Raises:
            kombu.exceptions.EncodeError: the body cannot be serialized.
            ValueError: the headers name no task or id (task protocol 1).
        """
        task, task_id = headers.get("task"), headers.get("id")
        if not isinstance(task, str) or not isinstance(task_id, str) or not task_id:
            raise ValueError("the message headers carry no task name and id (task protocol 1?)")
        # the message's own serializer, as kombu's Producer would apply it (kombu is untyped)
        content_type, content_encoding, data = serialize(  # type: ignore[no-untyped-call]
            body, serializer=serializer
        )
        if isinstance(data, str):
            data = data.encode(content_encoding or "utf-8")
        return cls(
            task=task,
            task_id=task_id,
            headers=dict(headers),
            body=bytes(data),
            content_type=content_type,
            content_encoding=content_encoding,
            exchange=str(getattr(exchange, "name", exchange) or ""),
            routing_key=str(routing_key or ""),
            properties=dict(properties or {}),
        )

    @property
    def task_key(self) -> str:
        """The claim store's task id of its attempt."""
        return claim_task_id(self.task_id, attempt_of(self.headers))

    @property
    def eta_ms(self) -> int | None:
        """Its ETA in epoch ms, or None."""
        return _epoch_ms(self.headers.get("eta"))

    def expired(self, now_ms: int) -> bool:
        """True if its ``expires`` has passed at ``now_ms`` (Celery would drop it)."""
        expires = _epoch_ms(self.headers.get("expires"))
        return expires is not None and now_ms >= expires

    def dumps(self) -> str:
        """The envelope as the journal stores it (JSON, the body in base64)."""
        return str(
            json.dumps(  # type: ignore[no-untyped-call]  # kombu is untyped
                {
                    "v": _VERSION,
                    "task": self.task,
                    "id": self.task_id,
                    "headers": dict(self.headers),
                    "body": base64.b64encode(self.body).decode("ascii"),
                    "content_type": self.content_type,
                    "content_encoding": self.content_encoding,
                    "exchange": self.exchange,
                    "routing_key": self.routing_key,
                    "properties": dict(self.properties),
                }
            )
        )

    @classmethod
    def loads(cls, text: str) -> Envelope:
        """The envelope :meth:`dumps` wrote.

        Raises:
            ValueError: not an envelope this version can read.
        """
        try:
            raw = json.loads(text)  # type: ignore[no-untyped-call]  # kombu is untyped
            if raw["v"] != _VERSION:
                raise ValueError(f"journal envelope version {raw['v']!r}")
            return cls(
                task=str(raw["task"]),
                task_id=str(raw["id"]),
                headers=dict(raw["headers"]),
                body=base64.b64decode(raw["body"]),
                content_type=str(raw["content_type"]),
                content_encoding=str(raw["content_encoding"]),
                exchange=str(raw["exchange"]),
                routing_key=str(raw["routing_key"]),
                properties=dict(raw["properties"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"unreadable journal envelope: {exc!r}") from exc


# --- the producer ------------------------------------------------------------------------


@dataclass(eq=False)
class _Capture:
    """What one ``send_task`` call of a journaling app publishes (set in a context var)."""

    app: Any
    serializer: str | None
    envelope: Envelope | None = None
    error: Exception | None = None
    exempt: bool = False
    #: written with the publish itself (:class:`~.compat.PublishRide`)
    journaled: bool = False


#: The ``send_task`` call in progress in this context (its app and what it publishes).
_publishing: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar(
    "celery_claims_publishing", default=None
)


def _on_before_publish(
    sender: Any = None,
    body: Any = None,
    exchange: Any = None,
    routing_key: Any = None,
    headers: Any = None,
    properties: Any = None,
    **_: Any,
) -> None:
    """``before_task_publish``: capture the message for the ``send_task`` call around it.

    No I/O here: the write comes once the broker has taken the message.
    """
    capture = _publishing.get()
    if capture is None or capture.envelope is not None or capture.error is not None:
        return  # not a journaling app's publish, or a nested one already captured
    try:
        name = str(sender)
        task = capture.app.tasks.get(name)
        if is_exempt(task, name):
            capture.exempt = True
            return
        serializer = (
            capture.serializer
            or getattr(task, "serializer", None)
            or capture.app.conf.task_serializer
        )
        capture.envelope = Envelope.of(
            body=body,
            serializer=serializer,
            headers=headers or {},
            exchange=exchange,
            routing_key=routing_key,
            properties=properties,
        )
    except Exception as exc:
        # a receiver's error would be swallowed by Celery's Signal.send; say it at the write
        capture.error = exc


_connect_lock = threading.Lock()
_receiver_connected = False


def _connect_receiver() -> None:
    global _receiver_connected
    with _connect_lock:
        if not _receiver_connected:
            # weak=False: a module-level function, connected once per process
            before_task_publish.connect(_on_before_publish, weak=False)
            _receiver_connected = True


class ProducerJournal:
    """Journals every message ``app`` publishes (see the module docstring).

    Settings are read on the first publish (``install`` may run before the app is
    configured); a configuration the journal cannot use turns it off in this process with
    one error naming the setting, and every publish is then counted as a failed write.

    Args:
        app: the Celery app.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.counters = PUBLISH_COUNTERS
        self._lock = threading.Lock()
        self._ready = False
        self._off: str | None = None
        self._enabled = True
        self._settings: ClaimsSettings | None = None
        self._journal: RedisJournal | None = None
        self._queues = QueueResolver(app)
        self._skip_until = 0.0
        self._retry_after_s = RETRY_AFTER_S / 2
        self._failing = False
        self._sender = ScriptSender(self._replied)
        self._sender_wrapped = False

    def configure(self, settings: ClaimsSettings) -> None:
        """Journal with ``settings`` from now on: a worker's own, command-line options
        included, handed over before its pool forks, so the retries and canvas its tasks
        publish are journaled where the worker's recovery looks."""
        with self._lock:
            self._settings = settings
            self._enabled = settings.journal
            self._off = None
            self._ready = True
            journal, self._journal = self._journal, None
        self.flush()
        if journal is not None:
            with contextlib.suppress(Exception):
                close_client(journal.client)

    def _setup(self) -> None:
        with self._lock:
            if self._ready:
                return
            try:
                settings = load_settings(self.app)
            except InvalidArgument as exc:
                self._off = str(exc)
                logger.error(
                    "celery-claims: the publish journal is off in this process: %s; messages "
                    "are published unjournaled",
                    exc,
                )
            else:
                self._settings = settings
                self._enabled = settings.journal
            self._ready = True

    def _store(self) -> RedisJournal:
        journal = self._journal
        if journal is None:
            assert self._settings is not None
            with self._lock:
                if self._journal is None:
                    timeout_ms = min(self._settings.socket_timeout_ms, PRODUCER_TIMEOUT_MS)
                    settings = dataclasses.replace(self._settings, socket_timeout_ms=timeout_ms)
                    self._journal = RedisJournal(
                        client=new_client(settings), prefix=self._settings.prefix
                    )
                journal = self._journal
        return journal

    def around(self, send_task: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``app.send_task``, with the published message journaled once it returns."""
        if not self._ready:
            self._setup()
        if not self._enabled:
            return send_task(*args, **kwargs)
        if not self._sender_wrapped:
            self._sender_wrapped = True
            wrap_task_sender(self.app, self._on_producer)
        capture = _Capture(self.app, kwargs.get("serializer"))
        token = _publishing.set(capture)
        try:
            result = send_task(*args, **kwargs)
        finally:
            _publishing.reset(token)
        if not capture.exempt and not capture.journaled:
            self._write(capture)
        return result

    def _on_producer(self, producer: Any) -> None:
        """Before a task message goes out on ``producer``: where its channel is the Redis
        broker's on the claim store's server, the journal entry rides the publish."""
        try:
            if self._off is not None or not self._enabled:
                return
            store = self._store()
            if ScriptSender.usable(store.client):
                PublishRide.hook(producer.channel, store.client, self._ride, self._rode)
        except Exception as exc:  # never fail a publish: the entry is then written on its own
            logger.debug("celery-claims: the journal cannot ride this producer: %r", exc)

    def _ride(self, queue: str, list_key: str, payload: str) -> ScriptCall[int] | None:
        """The journal write that goes with kombu's push of ``payload`` to ``queue``'s list,
        or None (kombu publishes alone; :meth:`_write` journals it after the publish)."""
        capture = _publishing.get()
        if (
            capture is None
            or capture.app is not self.app
            or capture.journaled
            or capture.exempt
            or capture.envelope is None
            or self._off is not None
            or time.monotonic() < self._skip_until
        ):
            return None
        try:
            store, queue_id, put = self._put_call(capture.envelope)
            if queue_id != queue:
                return None  # routed elsewhere too (or otherwise): journaled on its own
            return store.publish_call(put, list_key, payload)
        except Exception:  # the write on its own says what is wrong
            return None

    def _put_call(self, envelope: Envelope) -> tuple[RedisJournal, str, ScriptCall[int]]:
        """The journal's store, the queue ``envelope`` goes to, and its unsent entry."""
        assert self._settings is not None
        queue_id = self._queues.queue_of(
            {"exchange": envelope.exchange, "routing_key": envelope.routing_key}
        )
        store = self._store()
        put = store.put_call(
            queue_id,
            envelope.task_key,
            envelope.dumps(),
            recover_after_ms=self._settings.journal_recover_after_ms,
            eta_ms=envelope.eta_ms,
        )
        return store, queue_id, put

    def _rode(self) -> None:
        capture = _publishing.get()
        if capture is not None:
            capture.journaled = True
        self._written()

    def _write(self, capture: _Capture) -> None:
        """Journal what ``capture`` holds; never raises (the publish has succeeded).

        On a standalone store the write is sent without waiting for the reply (one write to
        the socket; :meth:`_replied` counts it when the reply comes): the publish is not held
        up by the store, and a store that stalls for a moment loses no entry. On Sentinel and
        Cluster it is one blocking round trip.
        """
        envelope = capture.envelope
        try:
            if self._off is not None:
                raise InvalidArgument("claims_journal", f"journal off: {self._off}")
            if envelope is None:
                raise capture.error or ValueError("no message was captured for the journal")
            if time.monotonic() < self._skip_until:
                self.counters.incr("journal_write_failed")
                return
            store, _, call = self._put_call(envelope)
            if ScriptSender.usable(store.client):
                self._sender.send(store.client, call)
                return  # counted by _replied
            with translate_errors():
                call.script(keys=call.keys, args=call.args)
        except Exception as exc:
            self._failed(exc, f"{envelope.task}[{envelope.task_id}]" if envelope else "")
            return
        self._written()

    def _replied(self, reply: Any, error: BaseException | None) -> None:
        """The store's reply to a journal write sent without waiting (see :meth:`_write`)."""
        if error is None:
            self._written()
        else:
            self._failed(error, "")

    def _written(self) -> None:
        self.counters.incr("journal_written")
        self._retry_after_s = RETRY_AFTER_S / 2
        if self._failing:
            self._failing = False
            logger.warning("celery-claims: the publish journal is written again")

    def _failed(self, exc: BaseException, what: str) -> None:
        self.counters.incr("journal_write_failed")
        if self._off is not None:
            return  # said once, when it was turned off
        if isinstance(exc, ClaimError):
            # the store: stop trying for a while, so an unreachable or hung one costs one
            # short timeout now and then, not one per publish
            self._retry_after_s = min(self._retry_after_s * 2, RETRY_AFTER_MAX_S)
            self._skip_until = time.monotonic() + self._retry_after_s
        if not self._failing:
            logger.warning(
                "celery-claims: could not journal %s (published all the same; a message lost "
                "before a worker records it cannot be recovered): %r",
                what or "a message",
                exc,
            )
        self._failing = isinstance(exc, ClaimError)

    def flush(self, timeout_s: float = PRODUCER_TIMEOUT_MS / 1000) -> bool:
        """Wait up to ``timeout_s`` for the replies to the writes sent so far (they are
        counted as they come); True if none is left. The writes themselves left already."""
        return self._sender.drain(timeout_s) == 0

    def close(self) -> None:
        """Close the journal's store client (a later publish reconnects), once the replies
        still to come have been read (for at most :data:`PRODUCER_TIMEOUT_MS`)."""
        self.flush()
        self._sender.close()
        with self._lock:
            journal, self._journal = self._journal, None
        if journal is not None:
            with contextlib.suppress(Exception):
                close_client(journal.client)


#: Attribute of a Celery app holding its producer journal.
_APP_ATTR = "_celery_claims_producer_journal"


def connect_producer(app: Any) -> ProducerJournal:
    """Journal every message ``app`` publishes (idempotent; ``install(app)`` calls it).

    ``app.close()`` closes the journal's store client too.
    """
    journal = getattr(app, _APP_ATTR, None)
    if isinstance(journal, ProducerJournal):
        return journal
    journal = ProducerJournal(app)
    setattr(app, _APP_ATTR, journal)
    _connect_receiver()
    wrap_send_task(app, journal.around)
    close_with(app, journal.close)
    return journal


# --- recovery ------------------------------------------------------------------------------


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
        if self.manager.done_record(queue_id, task_key) is not None:
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
        self._next_scan = 0.0
        self._scanner: threading.Thread | None = None
        self._sender = ScriptSender()
        # weak: the receiver goes with this object (in-process test workers come and go)
        task_revoked.connect(self._on_revoked)

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
            if sum(len(keys) for keys in self._pending.values()) < MAX_PENDING_CLEARS:
                self._pending.setdefault(queue_id, set()).add(task_key)

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
            pending, self._pending = self._pending, {}
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
