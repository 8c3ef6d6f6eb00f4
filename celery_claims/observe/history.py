"""The task history: what a worker decided about each copy of a task, kept per task id.

The claim store answers "who holds this claim, until when, is it done". It does not remember
the copies a worker did *not* run. The task history does: a short, capped, expiring list per
Celery task id of the claim gate's decisions about copies (skipped because done, held because
another lease is live or the store was down, waiting for a slot of a full lane, taken over,
lease lost, released after a failure). A worker writes it from a thread of its own
(:class:`~celery_claims.observe.writer.HistoryWriter`), never from its event loop;
``celery claims inspect`` and ``celery claims list`` read it.

(Not to be confused with the publish journal, :mod:`celery_claims.claims.journal`, a record of
*messages*: this one records decisions, for operators.)

Key, for prefix ``P``: ``P:journal:{<escaped task id>}`` (the name of earlier versions, where
this was the "event journal", kept so an upgrade keeps what was recorded), a list of JSON
events, newest first,
capped at :data:`HISTORY_MAX_EVENTS` and expiring :data:`DEFAULT_HISTORY_TTL_MS` after the last
event. One key per task id, so it lives in one Redis Cluster slot.

A keyed task's copy held while another task holds its key (``claims_key``, policy ``wait``)
is also indexed under the key, so that ``celery claims key K`` finds what waits on ``K``:
``P:journal:key:{<escaped key field>}``, a sorted set of the waiting task ids scored by when
they were held, capped at :data:`MAX_KEY_WAITERS` and expiring like a history. The index is
written only when a copy is held for a key, and a copy that then gets the key leaves it, so a
key nobody waits on has none.

:class:`SkipReason` is the vocabulary of the copies a worker acks without running: the
``reason`` of the ``task_skipped`` signal and of the history's ``skipped`` events.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from celery_claims.claims.calls import RedisClient, translate_errors
from celery_claims.claims.keys import escape, require_prefix
from celery_claims.errors import InvalidArgument
from celery_claims.validation import require_id

__all__ = [
    "DEFAULT_HISTORY_TTL_MS",
    "HISTORY_MAX_EVENTS",
    "History",
    "MAX_KEY_WAITERS",
    "HistoryEvent",
    "SKIP_REASONS",
    "SkipReason",
    "SkipMeaning",
    "history_key",
    "key_waiters_key",
    "skip_reasons_reference",
    "write_skip_reasons",
]

#: Events kept per task id (the newest); a task redelivered more often than this is rare.
HISTORY_MAX_EVENTS = 50
#: A history expires this long after its last event (the default completion retention).
DEFAULT_HISTORY_TTL_MS = 24 * 3600 * 1000
#: Task ids kept (the newest) in the index of the copies waiting on one key.
MAX_KEY_WAITERS = 1000


class SkipReason(str, enum.Enum):
    """Why a worker acked a copy without running it.

    The ``reason`` of the ``task_skipped`` signal, of the history's ``skipped`` events and of
    ``celery_claims.testing.SkippedCopy``. A ``str`` enum: each member equals its value, so
    ``reason == "done"`` holds for ``SkipReason.DONE``. What each means is
    :data:`SKIP_REASONS`; how ``celery claims inspect`` tells it,
    :data:`celery_claims.observe.render.SKIP_WORDING`.
    """

    DONE = "done"
    GIVEN_UP = "given_up"
    KEY_HELD = "key_held"
    KEY_RESCHEDULED = "key_rescheduled"
    KEY_DONE = "key_done"
    KEY_REFUSED = "key_refused"
    CLAIMED = "claimed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class SkipMeaning:
    """What one :class:`SkipReason` says happened.

    Attributes:
        when: when a worker acks a copy for this reason.
        record: what ``task_skipped`` passes as ``record`` (and the kit's
            ``SkippedCopy.record`` holds).
    """

    when: str
    record: str


#: Every skip reason, what it means and which record comes with it (docs/testing.md's list
#: is made from this table: :func:`skip_reasons_reference`).
SKIP_REASONS: Mapping[SkipReason, SkipMeaning] = MappingProxyType(
    {
        SkipReason.DONE: SkipMeaning(
            "an earlier copy of the same attempt completed",
            "the `AlreadyDone` record: who completed it, with which fencing number",
        ),
        SkipReason.GIVEN_UP: SkipMeaning(
            "the attempt was given up as poison: taken over `claims_max_takeovers` times",
            "the `GivenUp` record: the takeovers and the last holder",
        ),
        SkipReason.KEY_HELD: SkipMeaning(
            'a keyed task (`claims_key_conflict = "skip"`) met its key held by another task '
            "id; its result is stored as `REVOKED`",
            "the holder's `AlreadyClaimed` (its `owner` names the holding task)",
        ),
        SkipReason.KEY_RESCHEDULED: SkipMeaning(
            'a keyed task (`claims_key_conflict = "reschedule"`) met its key held by another '
            "task id: published again with a countdown, this copy acked",
            "the holder's `AlreadyClaimed`",
        ),
        SkipReason.KEY_DONE: SkipMeaning(
            "a keyed task met its key done by another task id within `claims_key_done_ttl`; "
            "its result is stored as `REVOKED`",
            "the key's `AlreadyDone` record (its `owner` names the task that did it)",
        ),
        SkipReason.KEY_REFUSED: SkipMeaning(
            "no key could be made from the message's arguments: recorded as failed with "
            "`KeyRefused`, never run",
            "`None` (the signal also passes `error`, the `KeyRefused`)",
        ),
        SkipReason.CLAIMED: SkipMeaning(
            "a copy of a task acknowledged at claim (`claims_ack_on_claim`) met it claimed by "
            "another copy's live lease with its publish journal entry in the store (both read "
            "in one script): the lease and the entry are its durable copy, published again by "
            "journal recovery if the holder dies; the entry stays",
            "the holder's `AlreadyClaimed` (its `owner` and lease expiry)",
        ),
    }
)


_BEGIN = "<!-- skip-reasons:begin (made from celery_claims/observe/history.py; do not edit) -->"
_END = "<!-- skip-reasons:end -->"


def skip_reasons_reference() -> str:
    """The Markdown table of :data:`SKIP_REASONS`, between its begin and end markers (the
    section of docs/testing.md that lists them)."""
    lines = [_BEGIN, "| `reason` | when | `record` |", "|---|---|---|"]
    lines += [
        f"| `{reason.value}` | {meaning.when} | {meaning.record} |"
        for reason, meaning in SKIP_REASONS.items()
    ]
    lines.append(_END)
    return "\n".join(lines)


def write_skip_reasons(path: Path) -> bool:
    """Replace the skip reasons' table in the Markdown file ``path``; True if it changed.

    Raises:
        InvalidArgument: the file has no begin and end markers.
    """
    text = path.read_text()
    pattern = re.compile(re.escape(_BEGIN) + r".*?" + re.escape(_END), re.DOTALL)
    if not pattern.search(text):
        raise InvalidArgument("path", f"{path} has no skip-reasons markers")
    new = pattern.sub(lambda _: skip_reasons_reference(), text)
    if new != text:
        path.write_text(new)
    return new != text


def history_key(prefix: str, task_id: str) -> str:
    """The history list of Celery task ``task_id``.

    Raises:
        InvalidArgument: a bad prefix or task id.
    """
    return f"{require_prefix(prefix)}:journal:{{{escape(require_id('task_id', task_id))}}}"


def key_waiters_key(prefix: str, key: str) -> str:
    """The index of the copies waiting on the key field ``key`` of keyed tasks (a task id's
    history key cannot be this one: its hash tag follows ``history:`` at once).

    Raises:
        InvalidArgument: a bad prefix or key.
    """
    return f"{require_prefix(prefix)}:journal:key:{{{escape(require_id('key', key))}}}"


@dataclass(frozen=True, slots=True)
class HistoryEvent:
    """One decision of a claim gate about one copy of a task.

    Attributes:
        at_ms: epoch ms (the worker's clock) of the decision.
        event: ``"skipped"`` (acked without running), ``"held"`` (kept unacked),
            ``"waiting"`` (claimed, waiting for a slot of its full lane), ``"lane_slot"`` (got
            the slot it waited for: to the pool), ``"rate_wait"`` (claimed, waiting for its
            fleet-wide rate), ``"rate_pass"`` (its rate let it start), ``"took_over"`` (ran
            after another owner's lease expired), ``"lease_lost"`` (fenced while running),
            ``"released"`` (the
            attempt ended without success, its claim released: a later copy runs it again),
            or ``"acquired"`` (ran; with ``record_acquired``, or a keyed copy that was held
            got its key).
        reason: for ``skipped``: a :class:`SkipReason` value; for ``held``:
            ``"held"`` (another lease is live) or ``"unavailable"`` (the claim store was
            down); for ``waiting`` and ``lane_slot``: the lane; for ``rate_wait`` and
            ``rate_pass``: the rate's limit name; for ``released``: why (e.g.
            ``"failed (ValueError)"``, ``"revoked"``, ``"hard time limit"``); else empty.
        worker: the worker's node name.
        claim_id: ``queue/task:retries:nesting`` (a keyed task's copy: ``queue/<key field>``,
            the key's claim; empty for ``key_refused``, which never had a claim).
        other: the other party: the holder (``held``), the completing owner (``skipped``, or
            the last holder when given up; for a keyed skip the task id that held or did the
            key, for ``key_refused`` the error), the previous owner (``took_over``), the key
            it waits for (``waiting`` in a keyed lane); empty if unknown.
        instance: the fencing number involved (0 if none).
        key: for a keyed task's copy (``claims_key``) held while another task holds its key,
            getting the key after it was held (``held``, ``acquired``, ``took_over``), or
            acked without running for its key (``skipped``), the key's field (``<task or
            namespace>[<key>]``); else empty. Such an event also adds the task to the key's
            waiters index (``held``) or removes it.
    """

    at_ms: int
    event: str
    reason: str = ""
    worker: str = ""
    claim_id: str = ""
    other: str = ""
    instance: int = 0
    key: str = ""

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form (what the history stores)."""
        return asdict(self)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class History:
    """Writes and reads the per-task task history in the claim store.

    Every call is one pipelined round trip and blocks until the store answers: a worker
    writes through a :class:`~celery_claims.observe.writer.HistoryWriter` instead, whose
    thread makes these calls.

    Args:
        client: the claim store's Redis client.
        prefix: the claim key prefix.
        ttl_ms: how long a history is kept after its last event.
        max_events: events kept per task.

    Raises:
        InvalidArgument: a bad prefix, ttl or cap.
    """

    def __init__(
        self,
        client: RedisClient,
        prefix: str,
        *,
        ttl_ms: int = DEFAULT_HISTORY_TTL_MS,
        max_events: int = HISTORY_MAX_EVENTS,
    ) -> None:
        self.client = client
        self.prefix = require_prefix(prefix)
        for name, value in (("ttl_ms", ttl_ms), ("max_events", max_events)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(name, f"must be a positive int, got {value!r:.80}")
        self.ttl_ms = ttl_ms
        self.max_events = max_events

    def record(self, task_id: str, event: HistoryEvent) -> None:
        """Add ``event`` to the history of ``task_id``.

        Raises:
            InvalidArgument: a bad task id or event.
            BackendUnavailable: Redis cannot be reached.
        """
        self.record_many([(task_id, event)])

    def record_many(self, events: Iterable[tuple[str, HistoryEvent]]) -> None:
        """Add each ``(task id, event)`` to its task's history, in order, in one round trip.

        Every pair is checked before anything is sent: a bad one writes nothing. An event
        naming a key (:attr:`HistoryEvent.key`) also adds the task to the key's waiters index
        (``held``) or takes it out (any other event).

        Raises:
            InvalidArgument: a bad task id or event.
            BackendUnavailable: Redis cannot be reached.
        """
        items = []
        for task_id, event in events:
            if not isinstance(event, HistoryEvent):
                raise InvalidArgument("event", f"must be a HistoryEvent, got {event!r:.80}")
            waiters = key_waiters_key(self.prefix, event.key) if event.key else None
            items.append((task_id, history_key(self.prefix, task_id), waiters, event))
        if not items:
            return
        with translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for task_id, key, waiters, event in items:
                pipe.lpush(key, json.dumps(event.as_dict(), separators=(",", ":")))
                pipe.ltrim(key, 0, self.max_events - 1)
                pipe.pexpire(key, self.ttl_ms)
                if waiters is None:
                    continue
                if event.event == "held":
                    pipe.zadd(waiters, {task_id: event.at_ms})
                    pipe.zremrangebyrank(waiters, 0, -MAX_KEY_WAITERS - 1)
                    pipe.pexpire(waiters, self.ttl_ms)
                else:
                    # the last waiter out removes the index: an idle key has none
                    pipe.zrem(waiters, task_id)
            pipe.execute()

    def waiters(self, key: str) -> list[str]:
        """The task ids indexed as waiting on the key field ``key``, oldest hold first (each
        one's own history tells whether it still waits: see
        :func:`~celery_claims.observe.views.find_key_waiters`).

        Raises:
            InvalidArgument: a bad key.
            BackendUnavailable: Redis cannot be reached.
        """
        index = key_waiters_key(self.prefix, key)
        with translate_errors():
            return [_text(member) for member in self.client.zrange(index, 0, -1)]

    def read(self, task_id: str) -> list[HistoryEvent]:
        """The history of ``task_id``, oldest first (entries this version cannot read are
        skipped).

        Raises:
            InvalidArgument: a bad task id.
            BackendUnavailable: Redis cannot be reached.
        """
        return self.read_many([task_id])[task_id]

    def read_many(self, task_ids: Iterable[str]) -> dict[str, list[HistoryEvent]]:
        """The histories of ``task_ids``, oldest first, in one pipelined round trip.

        Raises:
            InvalidArgument: a bad task id.
            BackendUnavailable: Redis cannot be reached.
        """
        ids = list(dict.fromkeys(task_ids))
        keys = [history_key(self.prefix, task_id) for task_id in ids]
        if not keys:
            return {}
        with translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.lrange(key, 0, -1)
            replies = pipe.execute()
        histories: dict[str, list[HistoryEvent]] = {}
        for task_id, raw in zip(ids, replies, strict=True):
            events = []
            for item in reversed(raw):
                try:
                    events.append(HistoryEvent(**json.loads(_text(item))))
                except (ValueError, TypeError):
                    continue
            histories[task_id] = events
        return histories
