"""The task history of a worker: signal receivers that post events, and the history's writer.

:func:`connect_history` (which ``install(app)`` calls) connects receivers to the claim gate's
signals; each builds a :class:`~celery_claims.observe.history.HistoryEvent` and *posts* it to
the worker's :class:`~celery_claims.observe.writer.HistoryWriter`, which writes from a thread
of its own: a receiver runs in the worker's event loop and never waits on the claim store.
The writer is made in the worker's main process when Celery's ``worker_ready`` is sent (the
``celery worker`` command sends it; pool processes are forked before and record nothing) and
stopped, after writing what it holds for a bounded time, by the worker's
``Claims task history`` bootstep (:func:`stop_history`).

This is the history of the gate's *decisions*, for operators (``celery claims inspect``); the
publish journal (:mod:`celery_claims.worker.publish`) is the record of *messages*.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from celery.signals import worker_ready

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.errors import InvalidArgument
from celery_claims.observe.history import DEFAULT_HISTORY_TTL_MS, History, HistoryEvent
from celery_claims.observe.writer import DEFAULT_STOP_TIMEOUT_S, HistoryWriter
from celery_claims.worker import signals

__all__ = [
    "attach_history",
    "connect_history",
    "history_connected",
    "history_writer",
    "stop_history",
]

logger = logging.getLogger("celery_claims.observe")

_connect_lock = threading.Lock()
_connected: dict[str, bool] = {}
#: Attribute of a Celery app holding its worker's history writer (set when the worker is ready).
_APP_ATTR = "_celery_claims_journal"
#: The worker counter of events the writer dropped (``worker.claims.counters``).
DROPPED_COUNTER = "events_dropped"


@dataclass
class _Options:
    record_acquired: bool = False
    ttl_ms: int = DEFAULT_HISTORY_TTL_MS


_options = _Options()


def history_writer(app: Any) -> HistoryWriter | None:
    """The history writer bound to ``app`` in this process, if any."""
    writer = getattr(app, _APP_ATTR, None)
    return writer if isinstance(writer, HistoryWriter) else None


def _post(request: Any, event: HistoryEvent) -> None:
    writer = history_writer(getattr(getattr(request, "task", None), "app", None))
    task_id = getattr(request, "id", None)
    if writer is not None and isinstance(task_id, str) and task_id:
        writer.post(task_id, event)  # never blocks, never raises


def _now_ms() -> int:
    return int(time.time() * 1000)


def _hostname(request: Any) -> str:
    return str(getattr(request, "hostname", "") or "")


def _on_skipped(
    sender: Any = None,
    request: Any = None,
    reason: str = "",
    claim_id: str = "",
    record: Any = None,
    holder_task_id: str | None = None,
    error: Any = None,
    key: str = "",
    **_: Any,
) -> None:
    # a completion record names its owner, a given-up record the last holder; a keyed
    # task's skip names the task id that held (or finished) the key, a refusal its error
    other = str(getattr(record, "owner", "") or getattr(record, "previous_owner", "") or "")
    if reason.startswith("key_") and holder_task_id:
        other = holder_task_id
    elif error is not None:
        other = str(error)
    _post(
        request,
        HistoryEvent(
            _now_ms(),
            "skipped",
            reason,
            _hostname(request),
            claim_id,
            other,
            int(getattr(record, "instance", 0) or 0),
            # a keyed copy's key: skipped, it waits on that key no more (`claims key`)
            key=key,
        ),
    )


def _on_held(
    sender: Any = None,
    request: Any = None,
    reason: str = "",
    claim_id: str = "",
    holder: str | None = None,
    lane: str = "",
    lane_key: str = "",
    instance: int = 0,
    key: str = "",
    **kwargs: Any,
) -> None:
    if reason == "lane":
        # claimed but not running: what `claims list/inspect` must not call running
        event = HistoryEvent(
            _now_ms(), "waiting", lane, _hostname(request), claim_id, lane_key, instance
        )
    elif reason == "rate":
        # so is a copy waiting for its fleet-wide rate
        rate = str(kwargs.get("rate", ""))
        event = HistoryEvent(
            _now_ms(), "rate_wait", rate, _hostname(request), claim_id, "", instance
        )
    else:
        # a keyed copy held by another task's claim on its key waits on that key (indexed
        # under it for `claims key`); held while the store is away it waits on nothing yet
        event = HistoryEvent(
            _now_ms(),
            "held",
            reason,
            _hostname(request),
            claim_id,
            holder or "",
            key=key if reason == "held" else "",
        )
    _post(request, event)


def _on_acquired(
    sender: Any = None,
    request: Any = None,
    token: Any = None,
    took_over: bool = False,
    previous_owner: str | None = None,
    claim_id: str = "",
    waited_key: str = "",
    **_: Any,
) -> None:
    # a keyed copy that was held gets its key: it waits on it no more (`claims key`)
    if not took_over and not waited_key and not _options.record_acquired:
        return
    _post(
        request,
        HistoryEvent(
            _now_ms(),
            "took_over" if took_over else "acquired",
            "",
            _hostname(request),
            claim_id,
            previous_owner or "",
            int(getattr(token, "instance", 0) or 0),
            key=waited_key,
        ),
    )


def _on_lane_slot(
    sender: Any = None,
    request: Any = None,
    claim_id: str = "",
    lane: str = "",
    instance: int = 0,
    **_: Any,
) -> None:
    event = HistoryEvent(_now_ms(), "lane_slot", lane, _hostname(request), claim_id, "", instance)
    _post(request, event)


def _on_rate_passed(
    sender: Any = None,
    request: Any = None,
    claim_id: str = "",
    rate: str = "",
    instance: int = 0,
    **_: Any,
) -> None:
    event = HistoryEvent(_now_ms(), "rate_pass", rate, _hostname(request), claim_id, "", instance)
    _post(request, event)


def _on_released(
    sender: Any = None,
    request: Any = None,
    token: Any = None,
    claim_id: str = "",
    reason: str = "",
    **_: Any,
) -> None:
    # a failed attempt leaves no claim nor record: without this `inspect` knows nothing
    instance = int(getattr(token, "instance", 0) or 0)
    event = HistoryEvent(_now_ms(), "released", reason, _hostname(request), claim_id, "", instance)
    _post(request, event)


def _on_lease_lost(sender: Any = None, request: Any = None, token: Any = None, **_: Any) -> None:
    _post(
        request,
        HistoryEvent(
            _now_ms(),
            "lease_lost",
            "",
            _hostname(request),
            f"{getattr(token, 'queue_id', '')}/{getattr(token, 'task_id', '')}",
            "",
            int(getattr(token, "instance", 0) or 0),
        ),
    )


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    # sender is the consumer; its controller holds the claim runtime (worker.claims)
    runtime = getattr(getattr(sender, "controller", None), "claims", None)
    manager = getattr(runtime, "manager", None)
    app = getattr(sender, "app", None)
    if not isinstance(manager, RedisClaimManager) or app is None:
        return
    current = history_writer(app)
    if current is not None and current.history.client is manager.client:
        return
    counters = getattr(runtime, "counters", None)
    on_drop = None
    if counters is not None and callable(getattr(counters, "incr", None)):

        def on_drop(count: int) -> None:
            counters.incr(DROPPED_COUNTER, count)

    history = History(manager.client, manager.prefix, ttl_ms=_options.ttl_ms)
    setattr(app, _APP_ATTR, HistoryWriter(history, on_drop=on_drop))
    if current is not None:
        current.stop(0)


def attach_history(app: Any, history: History | HistoryWriter) -> HistoryWriter:
    """Make the history receivers post ``app``'s events to ``history`` in this process (for
    in-process workers, which ``worker_ready`` does not reach).

    Args:
        app: the Celery app.
        history: a history (a writer is made for it) or a writer.

    Returns:
        The writer now bound to ``app`` (stop it with :func:`stop_history`).

    Raises:
        InvalidArgument: ``history`` is neither.
    """
    if isinstance(history, History):
        history = HistoryWriter(history)
    if not isinstance(history, HistoryWriter):
        raise InvalidArgument(
            "history", f"must be a History or a HistoryWriter, got {type(history).__name__}"
        )
    setattr(app, _APP_ATTR, history)
    return history


def stop_history(app: Any, *, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> bool:
    """Write what ``app``'s history writer holds, for at most ``timeout_s``, and stop its
    thread (reentrant, no logging: the worker's bootstep calls it at shutdown).

    Returns:
        True if nothing was left unwritten (or no writer is bound).
    """
    writer = history_writer(app)
    return True if writer is None else writer.stop(timeout_s)


def history_connected() -> bool:
    """True once :func:`connect_history` has connected the receivers in this process."""
    with _connect_lock:
        return bool(_connected.get("history"))


def connect_history(*, record_acquired: bool = False, ttl_ms: int = DEFAULT_HISTORY_TTL_MS) -> None:
    """Record the claim gate's decisions about copies in the task history (idempotent).

    Connects receivers to ``task_skipped``, ``task_held`` (including copies waiting for a
    full lane), ``lane_slot``, ``claim_acquired`` (takeovers, and every acquisition with
    ``record_acquired``), ``lease_lost`` and ``claim_released``, and to Celery's
    ``worker_ready``, where each worker's history writer is bound to its claim store. Call it
    in the module that creates the app, next to ``celery_claims.install(app)``.

    A receiver only queues its event in memory; the writer's thread writes what is queued,
    one pipelined round trip per batch, so no event holds up the worker's loop, even while
    the claim store is down (events are kept, the newest first, and written once it is
    back). Copies that are skipped or held, lane waits, takeovers, lease losses and released
    claims are journaled; a task that simply runs adds nothing unless ``record_acquired``.

    Args:
        record_acquired: also record every copy that ran (one more event per task).
        ttl_ms: how long a task's history is kept after its last event.

    Raises:
        InvalidArgument: a bad ``ttl_ms``.
    """
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms < 1:
        raise InvalidArgument("ttl_ms", f"must be a positive int, got {ttl_ms!r:.80}")
    with _connect_lock:
        _options.record_acquired = bool(record_acquired)
        _options.ttl_ms = ttl_ms
        # without record_acquired, a plain acquisition posts nothing: it is not even sent
        signals.hears_takeovers_only(_on_acquired, not record_acquired)
        if _connected.get("history"):
            return
        # weak=False: the receivers are module functions, but be explicit that they stay
        signals.task_skipped.connect(_on_skipped, weak=False)
        signals.task_held.connect(_on_held, weak=False)
        signals.claim_acquired.connect(_on_acquired, weak=False)
        signals.lease_lost.connect(_on_lease_lost, weak=False)
        signals.lane_slot.connect(_on_lane_slot, weak=False)
        signals.rate_passed.connect(_on_rate_passed, weak=False)
        signals.claim_released.connect(_on_released, weak=False)
        worker_ready.connect(_on_worker_ready, weak=False)
        _connected["history"] = True
