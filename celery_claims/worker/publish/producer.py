"""The producer's side of the publish journal: every message ``app.send_task`` publishes is
journaled (see :mod:`celery_claims.worker.publish`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery.signals import before_task_publish
from celery.utils.log import get_logger

from celery_claims.claims.calls import ScriptCall, translate_errors
from celery_claims.claims.journal import RedisJournal
from celery_claims.connection import close as close_client
from celery_claims.errors import ClaimError, InvalidArgument
from celery_claims.worker.compat import close_with, wrap_send_task, wrap_task_sender
from celery_claims.worker.identity import QueueResolver, attempt_task_id
from celery_claims.worker.policy import is_exempt
from celery_claims.worker.publish.envelope import Envelope, eta_ms_of, task_of
from celery_claims.worker.publish.runs import stamp
from celery_claims.worker.settings import ClaimsSettings, load_settings
from celery_claims.worker.signals import Counters
from celery_claims.worker.transport.publish import PublishRide
from celery_claims.worker.transport.sender import ScriptSender
from celery_claims.worker.transport.store import new_client

__all__ = [
    "PRODUCER_TIMEOUT_MS",
    "PUBLISH_COUNTERS",
    "RETRY_AFTER_S",
    "ProducerJournal",
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
#: Journal write replies left waiting before a publish reads those that came: a producer
#: publishing in a loop reads them in batches (one ``poll(2)`` and one ``recv(2)`` a batch,
#: where reading each before the next write cost five system calls a publish); each write
#: still leaves before its publish returns.
READ_EVERY = 16


@dataclass(eq=False, slots=True)
class _Message:
    """A task message as ``before_task_publish`` sees it, about to go out: what its journal
    entry is made of, serialized only where the entry is written apart (:meth:`envelope`);
    an entry riding the publish is kombu's own serialized message."""

    body: Any
    serializer: str
    headers: dict[str, Any]
    exchange: str
    routing_key: str
    properties: dict[str, Any]
    #: the claim store's task id of its attempt
    task_key: str

    def envelope(self) -> Envelope:
        """Its envelope (raises what :meth:`Envelope.of` raises)."""
        return Envelope.of(
            body=self.body,
            serializer=self.serializer,
            headers=self.headers,
            exchange=self.exchange,
            routing_key=self.routing_key,
            properties=self.properties,
        )


@dataclass(eq=False, slots=True)
class _Capture:
    """What one ``send_task`` call of a journaling app publishes (set in a context var)."""

    journal: ProducerJournal
    serializer: str | None
    message: _Message | None = None
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
    if capture is None or capture.message is not None or capture.error is not None:
        return  # not a journaling app's publish, or a nested one already captured
    try:
        name = str(sender)
        task = capture.journal.task(name)
        if is_exempt(task, name):
            capture.exempt = True
            return
        # the run first (whichever receiver runs first gives it): the entry keeps it, so a
        # re-published copy is the same run
        stamp(headers, body)
        serializer = (
            capture.serializer
            or getattr(task, "serializer", None)
            or capture.journal.app.conf.task_serializer
        )
        # a copy: kombu adds to the very dict as it publishes (``compression``, with the
        # body it compresses), and an envelope made later is of the message as given here
        headers = dict(headers or {})
        task_id = task_of(headers)[1]
        capture.message = _Message(
            body,
            serializer,
            headers,
            str(getattr(exchange, "name", exchange) or ""),
            str(routing_key or ""),
            dict(properties or {}),
            attempt_task_id(task_id, headers),
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
        self._sender = ScriptSender(self._replied, read_every=READ_EVERY)
        self._sender_wrapped = False
        self._tasks: Any = None  # app.tasks, once read (each read of it takes a lock)

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
        capture = _Capture(self, kwargs.get("serializer"))
        token = _publishing.set(capture)
        try:
            result = send_task(*args, **kwargs)
        finally:
            _publishing.reset(token)
        if not capture.exempt and not capture.journaled:
            self._write(capture)
        return result

    def task(self, name: str) -> Any:
        """The app's task ``name``, or None (read in the publish: it finalizes the app)."""
        tasks = self._tasks
        if tasks is None:
            tasks = self._tasks = self.app.tasks
        return tasks.get(name)

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
        """The journal write that goes with kombu's push of ``payload`` to ``queue``'s list
        (the entry is ``payload`` itself), or None (kombu publishes alone; :meth:`_write`
        journals it after the publish)."""
        capture = _publishing.get()
        if (
            capture is None
            or capture.journal is not self
            or capture.journaled
            or capture.exempt
            or capture.message is None
            or self._off is not None
            or time.monotonic() < self._skip_until
        ):
            return None
        try:
            message = capture.message
            queue_id = self._queue_of(message)
            if queue_id != queue:
                return None  # routed elsewhere too (or otherwise): journaled on its own
            assert self._settings is not None
            return self._store().publish_call(
                queue_id,
                message.task_key,
                list_key,
                payload,
                recover_after_ms=self._settings.journal_recover_after_ms,
                eta_ms=eta_ms_of(message.headers),
            )
        except Exception:  # the write on its own says what is wrong
            return None

    def _queue_of(self, message: _Message) -> str:
        return self._queues.queue_of(
            {"exchange": message.exchange, "routing_key": message.routing_key}
        )

    def _put_call(self, message: _Message) -> tuple[RedisJournal, ScriptCall[int]]:
        """The journal's store and ``message``'s unsent entry (its envelope).

        Raises:
            what :meth:`Envelope.of` raises: the body cannot be serialized.
        """
        assert self._settings is not None
        envelope = message.envelope()
        store = self._store()
        put = store.put_call(
            self._queue_of(message),
            message.task_key,
            envelope.dumps(),
            recover_after_ms=self._settings.journal_recover_after_ms,
            eta_ms=envelope.eta_ms,
        )
        return store, put

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
        message = capture.message
        try:
            if self._off is not None:
                raise InvalidArgument("claims_journal", f"journal off: {self._off}")
            if message is None:
                raise capture.error or ValueError("no message was captured for the journal")
            if time.monotonic() < self._skip_until:
                self.counters.incr("journal_write_failed")
                return
            store, call = self._put_call(message)
            if ScriptSender.usable(store.client):
                self._sender.send(store.client, call)
                return  # counted by _replied
            with translate_errors():
                call.script(keys=call.keys, args=call.args)
        except Exception as exc:
            what = f"{message.headers['task']}[{message.headers['id']}]" if message else ""
            self._failed(exc, what)
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
