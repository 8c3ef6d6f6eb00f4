"""What operators read: claims by Celery task id, lane occupancy, and the per-task journal.

The claim store answers "who holds this claim, until when, is it done". It does not remember
the copies a worker did *not* run. The **journal** does: a short, capped, expiring list per
Celery task id of the gate's decisions about copies (skipped because done, held because another
lease is live or the store was down, waiting for a slot of a full lane, taken over, lease lost,
released after a failure), written by receivers of the worker's signals
(:func:`connect_journal`) and read by ``celery claims inspect`` and ``celery claims list``
(which tell a claim waiting for its lane from one running, :func:`mark_waiting`).

Key, for prefix ``P``: ``P:journal:{<escaped task id>}``, a list of JSON events, newest first,
capped at :data:`JOURNAL_MAX_EVENTS` and expiring :data:`DEFAULT_JOURNAL_TTL_MS` after the last
event. One key per task id, so it lives in one Redis Cluster slot.

Only :func:`connect_journal` imports Celery (lazily): the readers work without it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from celery_claims.claims.keys import QueueKeys, escape, require_prefix
from celery_claims.claims.redis import RedisClaimManager, RedisClient, translate_errors
from celery_claims.errors import InvalidArgument
from celery_claims.validation import require_id

__all__ = [
    "DEFAULT_JOURNAL_TTL_MS",
    "JOURNAL_MAX_EVENTS",
    "MAX_PROBED_NESTING",
    "MAX_PROBED_RETRIES",
    "ClaimView",
    "Journal",
    "JournalEvent",
    "LaneOccupancy",
    "connect_journal",
    "journal_connected",
    "find_claims",
    "journal_key",
    "lane_occupancy",
    "mark_waiting",
    "server_now_ms",
]

logger = logging.getLogger("celery_claims.observe")

#: Events kept per task id (the newest); a task redelivered more often than this is rare.
JOURNAL_MAX_EVENTS = 50
#: A journal expires this long after its last event (the default completion retention).
DEFAULT_JOURNAL_TTL_MS = 24 * 3600 * 1000
#: ``find_claims`` probes attempts ``<id>:0..N:0..M``: Celery's default ``max_retries`` is 3,
#: and a task that retried more than this is found through ``list_claims`` anyway while live.
MAX_PROBED_RETRIES = 31
MAX_PROBED_NESTING = 3

_UNESCAPES = (("%3A", ":"), ("%7B", "{"), ("%7D", "}"), ("%25", "%"))


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _unescape(part: str) -> str:
    # the inverse of keys.escape: "%25" last, so "%253A" becomes "%3A", not ":"
    for escaped, plain in _UNESCAPES:
        part = part.replace(escaped, plain)
    return part


def server_now_ms(client: RedisClient) -> int:
    """The Redis server's clock in epoch ms (the clock claims expire by).

    Raises:
        BackendUnavailable: Redis cannot be reached.
    """
    with translate_errors():
        seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


# --- claims by Celery task id -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClaimView:
    """One claim or completion record of a Celery task, as ``celery claims`` shows it.

    Attributes:
        queue: the queue the claim is in.
        task_id: the Celery task id.
        attempt: ``"<retries>.<replaced nesting>"`` (``"0.0"`` for the first attempt).
        state: ``"running"`` (live lease), ``"waiting"`` (live lease, the copy waits for a
            slot of its full lane: see :func:`mark_waiting`), ``"expired"`` (lease ran out,
            not yet taken over or cleaned up), ``"done"`` (completion recorded) or
            ``"given_up"`` (taken over too often: a poison task, never run again while the
            record is kept).
        owner: the execution attempt (``hostname/pid/nonce``) that holds or completed it; for
            ``given_up``, the last one whose lease ran out.
        instance: the fencing number (0 for ``given_up``: the record has none).
        since_ms: epoch ms the claim was taken (``running``/``expired``), completed (``done``)
            or given up (``given_up``).
        until_ms: epoch ms the lease ends, or the record is kept until.
        remaining_ms: lease left (``running``), else 0.
        takeovers: for ``given_up``, the takeovers granted before it was given up, else 0.
        lane: for ``waiting``, the lane it waits for, else empty.
    """

    queue: str
    task_id: str
    attempt: str
    state: str
    owner: str
    instance: int
    since_ms: int
    until_ms: int
    remaining_ms: int
    takeovers: int = 0
    lane: str = ""

    @property
    def claim_id(self) -> str:
        """``queue/task:retries:nesting``, as the journal names the claim."""
        retries, _, nesting = self.attempt.partition(".")
        if not nesting:
            return f"{self.queue}/{self.task_id}"
        return f"{self.queue}/{self.task_id}:{retries}:{nesting}"

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return asdict(self)


def _split_claim_id(claim_task_id: str) -> tuple[str, str]:
    """``"<celery id>:<retries>:<nesting>"`` -> ``("<celery id>", "<retries>.<nesting>")``."""
    head, sep, nesting = claim_task_id.rpartition(":")
    task, sep2, retries = head.rpartition(":")
    if sep and sep2 and retries.isdigit() and nesting.isdigit():
        return task, f"{retries}.{nesting}"
    return claim_task_id, "-"


def _view(queue: str, field_name: str, raw: Any, now_ms: int, *, done: bool) -> ClaimView:
    # entries are "instance:created_at:expires_at:owner", records "instance:done_at:until:owner"
    # or, given up, "0:given_up_at:until:takeovers:owner" (see claims/keys.py); the owner may
    # itself contain ":", so split three times only
    instance, first, second, owner = _text(raw).split(":", 3)
    task_id, attempt = _split_claim_id(field_name)
    until = int(second)
    takeovers = 0
    if done and instance == "0":
        state, remaining = "given_up", 0
        count, owner = owner.split(":", 1)
        takeovers = int(count)
    elif done:
        state, remaining = "done", 0
    elif now_ms < until:
        state, remaining = "running", until - now_ms
    else:
        state, remaining = "expired", 0
    return ClaimView(
        queue,
        task_id,
        attempt,
        state,
        owner,
        int(instance),
        int(first),
        until,
        remaining,
        takeovers,
    )


def list_views(manager: RedisClaimManager, queue: str, now_ms: int) -> list[ClaimView]:
    """The live claims of ``queue`` as views, soonest expiry first."""
    views = [
        ClaimView(
            queue,
            *_split_claim_id(token.task_id),
            "running",
            token.owner,
            token.instance,
            token.created_at,
            token.expires_at,
            token.remaining_ms(now_ms),
        )
        for token in manager.list_claims(queue)
    ]
    return sorted(views, key=lambda v: (v.until_ms, v.task_id))


def find_claims(
    manager: RedisClaimManager,
    task_id: str,
    *,
    queues: Sequence[str] | None = None,
    now_ms: int | None = None,
) -> list[ClaimView]:
    """Every claim and completion record of the Celery task ``task_id``, in every queue.

    The claim store names a claim ``<task id>:<retries>:<nesting>`` (one per attempt), so this
    reads the candidate fields of each queue's claims and completion hashes with two ``HMGET``
    per queue, in one pipelined round trip: no scan of the hashes.

    Args:
        manager: the claim store.
        task_id: the Celery task id.
        queues: where to look (default: every known queue).
        now_ms: the time to judge leases by (default: the Redis server's clock).

    Returns:
        The views, by queue then attempt; empty if the store has nothing for the task.

    Raises:
        InvalidArgument: ``task_id`` is not a non-empty str.
        BackendUnavailable: Redis cannot be reached.
    """
    require_id("task_id", task_id)
    names = [
        f"{task_id}:{retries}:{nesting}"
        for retries in range(MAX_PROBED_RETRIES + 1)
        for nesting in range(MAX_PROBED_NESTING + 1)
    ]
    queue_ids = list(manager.known_queues() if queues is None else queues)
    now = server_now_ms(manager.client) if now_ms is None else now_ms
    with translate_errors():
        pipe = manager.client.pipeline(transaction=False)
        for queue in queue_ids:
            keys = QueueKeys(manager.prefix, queue)
            pipe.hmget(keys.claims, names)
            pipe.hmget(keys.done, names)
        replies = pipe.execute()
    views: list[ClaimView] = []
    for index, queue in enumerate(queue_ids):
        live, done = replies[2 * index], replies[2 * index + 1]
        for name, raw in zip(names, live, strict=True):
            if raw is not None:
                views.append(_view(queue, name, raw, now, done=False))
        for name, raw in zip(names, done, strict=True):
            # a completion record past its retention is gone for the gate: hide it here too
            if raw is not None and (view := _view(queue, name, raw, now, done=True)).until_ms > now:
                views.append(view)
    return views


def mark_waiting(
    views: Iterable[ClaimView], journals: Mapping[str, Sequence[JournalEvent]]
) -> list[ClaimView]:
    """``views`` with every live claim whose copy waits for a lane slot marked ``"waiting"``.

    A copy is claimed before it waits for its lane, so the claim store alone shows it as
    running. The worker journals when a copy starts waiting for a full lane (``waiting``) and
    when it gets its slot (``lane_slot``): a live claim whose latest such event, for the same
    claim and fencing number, is ``waiting`` has not reached the pool.

    Args:
        views: claim views (any state; only ``running`` ones can change).
        journals: task id -> its journal, oldest first (:meth:`Journal.read_many`).
    """
    marked = []
    for view in views:
        if view.state == "running":
            last = None
            for event in journals.get(view.task_id, ()):
                if (
                    event.event in ("waiting", "lane_slot")
                    and event.claim_id == view.claim_id
                    and event.instance == view.instance
                ):
                    last = event
            if last is not None and last.event == "waiting":
                view = replace(view, state="waiting", lane=last.reason)
        marked.append(view)
    return marked


# --- lanes --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LaneOccupancy:
    """How full one lane is, per kind, fleet-wide.

    Attributes:
        lane: the lane key.
        kind: the task kind.
        active: tasks processing with a live lease (using the lane's slots).
        waiting: tasks pending or due for a retry.
        limit: the lane's limit if known (from the configuration), else ``None``.
    """

    lane: str
    kind: str
    active: int
    waiting: int
    limit: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return asdict(self)


def _lane_of_key(key: str, base: str) -> tuple[str, str] | None:
    # "<prefix>:lane:{<lane>}:processing:<kind>"; escaped parts contain no "{", "}" or ":"
    if not key.startswith(base):
        return None
    rest = key[len(base) :]
    lane, sep, tail = rest.partition("}:processing:")
    if not sep or ":" in tail:
        return None
    return _unescape(lane), _unescape(tail)


def lane_occupancy(
    client: RedisClient,
    prefix: str,
    *,
    now_ms: int | None = None,
    limits: Mapping[str, int] | None = None,
) -> list[LaneOccupancy]:
    """Occupancy of every lane of the Redis lane store under ``prefix``.

    Lanes are found by a ``SCAN`` for their ``processing`` keys (an operator's read, not a hot
    path; a lane that never processed a task has no such key yet and is not listed).

    Args:
        client: a Redis client.
        prefix: the lane store's key prefix.
        now_ms: the time leases are judged by (default: the Redis server's clock).
        limits: lane key -> limit, to show next to the counts.

    Returns:
        One entry per (lane, kind), sorted.

    Raises:
        InvalidArgument: a bad prefix.
        BackendUnavailable: Redis cannot be reached.
    """
    require_prefix(prefix)
    base = f"{prefix}:lane:{{"
    now = server_now_ms(client) if now_ms is None else now_ms
    with translate_errors():
        found = sorted(
            {
                parsed
                for key in client.scan_iter(match=f"{base}*}}:processing:*", count=1000)
                if (parsed := _lane_of_key(_text(key), base)) is not None
            }
        )
        pipe = client.pipeline(transaction=False)
        for lane, kind in found:
            lane_base = f"{base}{escape(lane)}}}"
            # lane scores are epoch microseconds; a lease is live while its expiry is after now
            pipe.zcount(f"{lane_base}:processing:{escape(kind)}", f"({now * 1000}", "+inf")
            pipe.zcard(f"{lane_base}:due:{escape(kind)}")
        counts = pipe.execute() if found else []
    return [
        LaneOccupancy(lane, kind, int(active), int(waiting), (limits or {}).get(lane))
        for (lane, kind), active, waiting in zip(found, counts[::2], counts[1::2], strict=True)
    ]


# --- the journal --------------------------------------------------------------------------


def journal_key(prefix: str, task_id: str) -> str:
    """The journal list of Celery task ``task_id``."""
    return f"{require_prefix(prefix)}:journal:{{{escape(require_id('task_id', task_id))}}}"


@dataclass(frozen=True, slots=True)
class JournalEvent:
    """One decision of a claim gate about one copy of a task.

    Attributes:
        at_ms: epoch ms (the worker's clock) of the decision.
        event: ``"skipped"`` (acked without running), ``"held"`` (kept unacked),
            ``"waiting"`` (claimed, waiting for a slot of its full lane), ``"lane_slot"`` (got
            the slot it waited for: to the pool), ``"took_over"`` (ran after another owner's
            lease expired), ``"lease_lost"`` (fenced while running), ``"released"`` (the
            attempt ended without success, its claim released: a later copy runs it again),
            or ``"acquired"`` (ran; only with ``record_acquired``).
        reason: for ``skipped``: ``"done"`` or ``"given_up"`` (a poison task); for ``held``:
            ``"held"`` (another lease is live) or ``"unavailable"`` (the claim store was
            down); for ``waiting`` and ``lane_slot``: the lane; for ``released``: why (e.g.
            ``"failed (ValueError)"``, ``"revoked"``, ``"hard time limit"``); else empty.
        worker: the worker's node name.
        claim_id: ``queue/task:retries:nesting``.
        other: the other party: the holder (``held``), the completing owner (``skipped``, or
            the last holder when given up), the previous owner (``took_over``); empty if
            unknown.
        instance: the fencing number involved (0 if none).
    """

    at_ms: int
    event: str
    reason: str = ""
    worker: str = ""
    claim_id: str = ""
    other: str = ""
    instance: int = 0

    def describe(self) -> str:
        """One line for humans."""
        if self.event == "skipped" and self.reason == "given_up":
            return (
                f"copy acked without running on {self.worker}: the task was given up as "
                f"poison (taken over too often; last holder {self.other})"
            )
        if self.event == "skipped":
            return (
                f"copy acked without running on {self.worker}: already done by {self.other} "
                f"(instance {self.instance})"
            )
        if self.event == "held" and self.reason == "unavailable":
            return f"copy held unacked on {self.worker}: the claim store was unreachable"
        if self.event == "held":
            return f"copy held unacked on {self.worker}: lease held by {self.other or '?'}"
        if self.event == "took_over":
            previous = f" from {self.other}" if self.other else ""
            return f"taken over by {self.worker}{previous} (instance {self.instance})"
        if self.event == "lease_lost":
            return f"lease lost on {self.worker} (instance {self.instance}): result fenced"
        if self.event == "waiting":
            return (
                f"claimed on {self.worker} (instance {self.instance}), waiting for a slot of "
                f"lane {self.reason} (full)"
            )
        if self.event == "lane_slot":
            return (
                f"got a slot of lane {self.reason} on {self.worker} (instance "
                f"{self.instance}): handed to the pool"
            )
        if self.event == "released":
            return (
                f"ended without success on {self.worker}: {self.reason} (instance "
                f"{self.instance}); claim released, a later copy runs it again"
            )
        return f"run by {self.worker} (instance {self.instance})"


class Journal:
    """Writes and reads the per-task journal.

    Args:
        client: the claim store's Redis client.
        prefix: the claim key prefix.
        ttl_ms: how long a journal is kept after its last event.
        max_events: events kept per task.
        call_soon: schedules a call on the worker's event loop (``consumer.call_soon``):
            :meth:`record_soon` then writes every event of one loop turn in one round trip;
            without it :meth:`record_soon` writes at once.

    Raises:
        InvalidArgument: a bad prefix, ttl or cap.
    """

    def __init__(
        self,
        client: RedisClient,
        prefix: str,
        *,
        ttl_ms: int = DEFAULT_JOURNAL_TTL_MS,
        max_events: int = JOURNAL_MAX_EVENTS,
        call_soon: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        self.client = client
        self.prefix = require_prefix(prefix)
        for name, value in (("ttl_ms", ttl_ms), ("max_events", max_events)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(name, f"must be a positive int, got {value!r:.80}")
        self.ttl_ms = ttl_ms
        self.max_events = max_events
        self.call_soon = call_soon
        self._pending: list[tuple[str, JournalEvent]] = []
        self._pending_lock = threading.Lock()

    def record(self, task_id: str, event: JournalEvent) -> None:
        """Add ``event`` to the journal of ``task_id`` (one pipelined round trip).

        Raises:
            InvalidArgument: a bad task id.
            BackendUnavailable: Redis cannot be reached.
        """
        self._write([(journal_key(self.prefix, task_id), event)])

    def record_soon(self, task_id: str, event: JournalEvent) -> None:
        """Add ``event`` on the next turn of the worker's loop, with every other event of
        this turn, in one round trip (at once without ``call_soon``). From any thread.

        Raises:
            InvalidArgument: a bad task id.
            BackendUnavailable: Redis cannot be reached (only when written at once).
        """
        key = journal_key(self.prefix, task_id)
        if self.call_soon is None:
            self._write([(key, event)])
            return
        with self._pending_lock:
            first = not self._pending
            self._pending.append((key, event))
        if first:
            self.call_soon(self.flush)

    def flush(self) -> None:
        """Write the events :meth:`record_soon` keeps (one round trip); never raises."""
        with self._pending_lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            self._write(pending)
        except Exception as exc:
            # the journal is an aid: a lost batch must never disturb the worker's loop
            logger.debug("celery-claims journal: %d event(s) not recorded: %r", len(pending), exc)

    def _write(self, items: Sequence[tuple[str, JournalEvent]]) -> None:
        with translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for key, event in items:
                pipe.lpush(key, json.dumps(asdict(event), separators=(",", ":")))
                pipe.ltrim(key, 0, self.max_events - 1)
                pipe.pexpire(key, self.ttl_ms)
            pipe.execute()

    def read(self, task_id: str) -> list[JournalEvent]:
        """The journal of ``task_id``, oldest first (entries this version cannot read are
        skipped).

        Raises:
            InvalidArgument: a bad task id.
            BackendUnavailable: Redis cannot be reached.
        """
        return self.read_many([task_id])[task_id]

    def read_many(self, task_ids: Iterable[str]) -> dict[str, list[JournalEvent]]:
        """The journals of ``task_ids``, oldest first, in one pipelined round trip.

        Raises:
            InvalidArgument: a bad task id.
            BackendUnavailable: Redis cannot be reached.
        """
        ids = list(dict.fromkeys(task_ids))
        keys = [journal_key(self.prefix, task_id) for task_id in ids]
        if not keys:
            return {}
        with translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.lrange(key, 0, -1)
            replies = pipe.execute()
        journals: dict[str, list[JournalEvent]] = {}
        for task_id, raw in zip(ids, replies, strict=True):
            events = []
            for item in reversed(raw):
                try:
                    events.append(JournalEvent(**json.loads(_text(item))))
                except (ValueError, TypeError):
                    continue
            journals[task_id] = events
        return journals


# --- wiring to the worker's signals -------------------------------------------------------

_connect_lock = threading.Lock()
_connected: dict[str, bool] = {}
#: Attribute of a Celery app holding its worker's journal (set when the worker is ready).
_APP_ATTR = "_celery_claims_journal"


@dataclass
class _Options:
    record_acquired: bool = False
    ttl_ms: int = DEFAULT_JOURNAL_TTL_MS


_options = _Options()


def _journal_of(request: Any) -> Journal | None:
    app = getattr(getattr(request, "task", None), "app", None)
    journal = getattr(app, _APP_ATTR, None)
    return journal if isinstance(journal, Journal) else None


def _write(request: Any, event: JournalEvent, *, soon: bool = False) -> None:
    journal = _journal_of(request)
    task_id = getattr(request, "id", None)
    if journal is None or not isinstance(task_id, str) or not task_id:
        return
    try:
        if soon:
            journal.record_soon(task_id, event)
        else:
            journal.record(task_id, event)
    except Exception as exc:
        # the journal is an aid: never let it disturb the gate (receivers run in its loop)
        logger.debug("celery-claims journal: could not record %s: %r", event.event, exc)


def _now_ms() -> int:
    import time

    return int(time.time() * 1000)


def _hostname(request: Any) -> str:
    return str(getattr(request, "hostname", "") or "")


def _on_skipped(
    sender: Any = None,
    request: Any = None,
    reason: str = "",
    claim_id: str = "",
    record: Any = None,
    **_: Any,
) -> None:
    _write(
        request,
        JournalEvent(
            _now_ms(),
            "skipped",
            reason,
            _hostname(request),
            claim_id,
            # a completion record names its owner, a given-up record the last holder
            str(getattr(record, "owner", "") or getattr(record, "previous_owner", "") or ""),
            int(getattr(record, "instance", 0) or 0),
        ),
    )


def _on_held(
    sender: Any = None,
    request: Any = None,
    reason: str = "",
    claim_id: str = "",
    holder: str | None = None,
    lane: str = "",
    instance: int = 0,
    **_: Any,
) -> None:
    if reason == "lane":
        # claimed but not running: what `claims list/inspect` must not call running. Written
        # with the rest of the loop turn (one round trip per lane pass, not per message)
        event = JournalEvent(_now_ms(), "waiting", lane, _hostname(request), claim_id, "", instance)
        _write(request, event, soon=True)
        return
    _write(
        request,
        JournalEvent(_now_ms(), "held", reason, _hostname(request), claim_id, holder or ""),
    )


def _on_acquired(
    sender: Any = None,
    request: Any = None,
    token: Any = None,
    took_over: bool = False,
    previous_owner: str | None = None,
    **_: Any,
) -> None:
    if not took_over and not _options.record_acquired:
        return
    claim = getattr(request, "claim", None)
    _write(
        request,
        JournalEvent(
            _now_ms(),
            "took_over" if took_over else "acquired",
            "",
            _hostname(request),
            str(getattr(claim, "claim_id", "") or ""),
            previous_owner or "",
            int(getattr(token, "instance", 0) or 0),
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
    event = JournalEvent(_now_ms(), "lane_slot", lane, _hostname(request), claim_id, "", instance)
    _write(request, event, soon=True)


def _on_released(
    sender: Any = None,
    request: Any = None,
    token: Any = None,
    claim_id: str = "",
    reason: str = "",
    **_: Any,
) -> None:
    # a failed attempt leaves no claim nor record: without this `inspect` knows nothing
    event = JournalEvent(
        _now_ms(),
        "released",
        reason,
        _hostname(request),
        claim_id,
        "",
        int(getattr(token, "instance", 0) or 0),
    )
    _write(request, event, soon=True)


def _on_lease_lost(sender: Any = None, request: Any = None, token: Any = None, **_: Any) -> None:
    _write(
        request,
        JournalEvent(
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
    call_soon = getattr(sender, "call_soon", None)
    journal = Journal(
        manager.client,
        manager.prefix,
        ttl_ms=_options.ttl_ms,
        call_soon=call_soon if callable(call_soon) else None,
    )
    setattr(app, _APP_ATTR, journal)


def attach_journal(app: Any, journal: Journal) -> None:
    """Make the journal receivers write ``app``'s events to ``journal`` (for in-process use)."""
    if not isinstance(journal, Journal):
        raise InvalidArgument("journal", f"must be a Journal, got {type(journal).__name__}")
    setattr(app, _APP_ATTR, journal)


def journal_connected() -> bool:
    """True once :func:`connect_journal` has connected the receivers in this process."""
    with _connect_lock:
        return bool(_connected.get("journal"))


def connect_journal(*, record_acquired: bool = False, ttl_ms: int = DEFAULT_JOURNAL_TTL_MS) -> None:
    """Record the claim gate's decisions about copies in the journal (idempotent).

    Connects receivers to ``task_skipped``, ``task_held`` (including copies waiting for a
    full lane), ``lane_slot``, ``claim_acquired`` (takeovers, and every acquisition with
    ``record_acquired``), ``lease_lost`` and ``claim_released``, and to Celery's
    ``worker_ready``, where each worker's journal is bound to its claim store. Call it in the
    module that creates the app, next to ``celery_claims.install(app)``.

    Each recorded event costs the worker one pipelined round trip to the claim store, in the
    consumer loop; copies that are skipped or held, takeovers and lease losses are rare, so the
    default adds nothing to a task that simply runs. Lane waits and released claims are
    written on the next loop turn, every event of one turn in one round trip: a lane pass
    that holds or admits many messages costs one round trip more, not one per message.

    Args:
        record_acquired: also record every copy that ran (one more round trip per task).
        ttl_ms: how long a task's journal is kept after its last event.

    Raises:
        InvalidArgument: a bad ``ttl_ms``.
    """
    if isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int) or ttl_ms < 1:
        raise InvalidArgument("ttl_ms", f"must be a positive int, got {ttl_ms!r:.80}")
    from celery.signals import worker_ready

    from celery_claims.worker import signals

    with _connect_lock:
        _options.record_acquired = bool(record_acquired)
        _options.ttl_ms = ttl_ms
        if _connected.get("journal"):
            return
        # weak=False: the receivers are module functions, but be explicit that they stay
        signals.task_skipped.connect(_on_skipped, weak=False)
        signals.task_held.connect(_on_held, weak=False)
        signals.claim_acquired.connect(_on_acquired, weak=False)
        signals.lease_lost.connect(_on_lease_lost, weak=False)
        signals.lane_slot.connect(_on_lane_slot, weak=False)
        signals.claim_released.connect(_on_released, weak=False)
        worker_ready.connect(_on_worker_ready, weak=False)
        _connected["journal"] = True


def describe_views(views: Iterable[ClaimView]) -> list[str]:
    """One line per view, for humans."""
    lines = []
    for v in views:
        if v.state == "done":
            lines.append(
                f"{v.queue}: attempt {v.attempt} done by {v.owner} (instance {v.instance})"
            )
        elif v.state == "given_up":
            lines.append(
                f"{v.queue}: attempt {v.attempt} given up as poison (takeovers: {v.takeovers}, "
                f"last holder {v.owner})"
            )
        elif v.state == "waiting":
            lines.append(
                f"{v.queue}: attempt {v.attempt} claimed by {v.owner} (instance {v.instance}), "
                f"waiting for a slot of lane {v.lane}; lease {v.remaining_ms / 1000:.1f} s left"
            )
        elif v.state == "running":
            lines.append(
                f"{v.queue}: attempt {v.attempt} held by {v.owner} (instance {v.instance}), "
                f"lease {v.remaining_ms / 1000:.1f} s left"
            )
        else:
            lines.append(
                f"{v.queue}: attempt {v.attempt} lease of {v.owner} expired "
                f"(instance {v.instance}); the next copy takes it over"
            )
    return lines
