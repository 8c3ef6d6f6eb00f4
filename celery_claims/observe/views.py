"""Reading views: what ``celery claims list``, ``stats`` and ``inspect`` compute from the store.

A claim or completion record of a Celery task becomes a :class:`ClaimView`; the lane store's
``processing`` and ``due`` sets become :class:`LaneOccupancy`. A copy waiting for a slot of its
full lane holds a live claim like a running one: :func:`mark_waiting` tells them apart with
the task history (:mod:`celery_claims.observe.history`); :func:`find_key_waiters` finds the
copies waiting on one key, of a keyed task or a keyed lane. Nothing here writes to the store.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from celery_claims.claims.calls import RedisClient, translate_errors
from celery_claims.claims.keys import escape, owner_task_key, require_prefix
from celery_claims.claims.redis import RedisClaimManager, StoredTask
from celery_claims.model import GivenUp
from celery_claims.observe.history import History, HistoryEvent
from celery_claims.validation import require_id

__all__ = [
    "DEFAULT_TOP_KEYS",
    "FleetStats",
    "MAX_PROBED_NESTING",
    "MAX_PROBED_RETRIES",
    "ClaimView",
    "KeyWaiter",
    "LaneOccupancy",
    "find_claims",
    "find_key",
    "find_key_waiters",
    "fleet_stats",
    "is_key_field",
    "lane_key_running",
    "lane_occupancy",
    "list_views",
    "mark_waiting",
    "server_now_ms",
    "waiting_per_lane",
    "waiting_per_rate",
    "with_celery_lanes",
]

#: ``find_claims`` probes attempts ``<id>:0..N:0..M``: Celery's default ``max_retries`` is 3,
#: and a task that retried more than this is found through ``list_claims`` anyway while live.
MAX_PROBED_RETRIES = 31
MAX_PROBED_NESTING = 3

_UNESCAPES = (("%3A", ":"), ("%7B", "{"), ("%7D", "}"), ("%25", "%"))


#: How many keys of a keyed lane ``lane_occupancy`` reports (and the exporter labels).
DEFAULT_TOP_KEYS = 10


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
        rate: for ``waiting``, the fleet-wide rate it waits for (a limit's name, e.g.
            ``task:proj.send``), else empty.
        key: for a keyed task's claim (``claims_key``), the key's field
            (``<task or namespace>[<key>]``): ``task_id`` and ``attempt`` are then the holder's
            (or, for ``done``, the task that finished the key); else empty.
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
    key: str = ""
    rate: str = ""

    @property
    def claim_id(self) -> str:
        """``queue/task:retries:nesting`` (``queue/<key>`` when keyed), as the history names
        the claim."""
        if self.key:
            return f"{self.queue}/{self.key}"
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


def _keyed(view: ClaimView) -> ClaimView:
    """A view of a keyed claim names the attempt its owner names, and the key."""
    task_key = owner_task_key(view.owner)
    if task_key is None or view.attempt != "-":
        return view
    task_id, attempt = _split_claim_id(task_key)
    return replace(view, task_id=task_id, attempt=attempt, key=view.task_id)


def _claim_view(queue: str, stored: StoredTask, now_ms: int) -> ClaimView | None:
    token = stored.claim
    if token is None:
        return None
    task_id, attempt = _split_claim_id(stored.task_id)
    live = now_ms < token.expires_at
    return _keyed(
        ClaimView(
            queue,
            task_id,
            attempt,
            "running" if live else "expired",
            token.owner,
            token.instance,
            token.created_at,
            token.expires_at,
            token.remaining_ms(now_ms),
        )
    )


def _record_view(queue: str, stored: StoredTask, now_ms: int) -> ClaimView | None:
    record = stored.record
    # a completion record past its retention is gone for the gate: hide it here too
    if record is None or stored.record_until_ms <= now_ms:
        return None
    task_id, attempt = _split_claim_id(stored.task_id)
    if isinstance(record, GivenUp):
        return ClaimView(
            queue,
            task_id,
            attempt,
            "given_up",
            record.previous_owner,
            0,
            record.given_up_at,
            stored.record_until_ms,
            0,
            record.takeovers,
        )
    return _keyed(
        ClaimView(
            queue,
            task_id,
            attempt,
            "done",
            record.owner,
            record.instance,
            record.done_at,
            stored.record_until_ms,
            0,
        )
    )


def list_views(manager: RedisClaimManager, queue: str, now_ms: int) -> list[ClaimView]:
    """The live claims of ``queue`` as views, soonest expiry first."""
    views = [
        _keyed(
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
        )
        for token in manager.list_claims(queue)
    ]
    return sorted(views, key=lambda v: (v.until_ms, v.task_id))


def _attempt_names(task_id: str) -> list[str]:
    """The claim names ``find_claims`` probes for the attempts of ``task_id``."""
    return [
        f"{task_id}:{retries}:{nesting}"
        for retries in range(MAX_PROBED_RETRIES + 1)
        for nesting in range(MAX_PROBED_NESTING + 1)
    ]


def find_claims(
    manager: RedisClaimManager,
    task_id: str,
    *,
    queues: Sequence[str] | None = None,
    now_ms: int | None = None,
) -> list[ClaimView]:
    """Every claim and completion record of the Celery task ``task_id``, in every queue.

    The claim store names a claim ``<task id>:<retries>:<nesting>`` (one per attempt), so this
    reads the candidate names of each queue with one script call per queue, in one pipelined
    round trip: no scan of the hashes.

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
    names = _attempt_names(task_id)
    queue_ids = list(manager.known_queues() if queues is None else queues)
    now = server_now_ms(manager.client) if now_ms is None else now_ms
    found = manager.execute_many([manager.read_call(queue, names) for queue in queue_ids])
    views: list[ClaimView] = []
    for queue, stored in zip(queue_ids, found, strict=True):
        views += [v for s in stored if (v := _claim_view(queue, s, now)) is not None]
        views += [v for s in stored if (v := _record_view(queue, s, now)) is not None]
    return views


def is_key_field(name: str) -> bool:
    """Whether ``name`` has the form of a key: ``<task or namespace>[<key>]`` (a keyed task's
    claim, as ``celery claims list`` shows it in its ``KEY`` column) or ``<lane>[<key>]`` (a
    keyed lane's). A task id or a bare key value has not."""
    scope, bracket, rest = name.partition("[")
    return bool(scope) and bool(bracket) and rest.endswith("]")


def find_key(
    manager: RedisClaimManager,
    key: str,
    *,
    queues: Sequence[str] | None = None,
    now_ms: int | None = None,
) -> list[ClaimView]:
    """Who holds the key ``key`` of keyed tasks, and whether it is kept done, in every queue.

    Args:
        manager: the claim store.
        key: the key's field, ``<task name or claims_key_namespace>[<key>]`` as
            ``celery claims list`` shows it (e.g. ``tasks.sync['acme']``).
        queues: where to look (default: every known queue; a namespace is a queue of its own).
        now_ms: the time to judge leases by (default: the Redis server's clock).

    Returns:
        Its live or expired claim (the holder's task id and attempt) and its record (kept by
        ``claims_key_done_ttl``), by queue; empty if the store has neither.

    Raises:
        InvalidArgument: ``key`` is not a non-empty str.
        BackendUnavailable: Redis cannot be reached.
    """
    require_id("key", key)
    queue_ids = list(manager.known_queues() if queues is None else queues)
    now = server_now_ms(manager.client) if now_ms is None else now_ms
    found = manager.execute_many([manager.read_call(queue, [key]) for queue in queue_ids])
    views: list[ClaimView] = []
    for queue, stored in zip(queue_ids, found, strict=True):
        views += [v for s in stored if (v := _claim_view(queue, s, now)) is not None]
        views += [v for s in stored if (v := _record_view(queue, s, now)) is not None]
    return views


def mark_waiting(
    views: Iterable[ClaimView], histories: Mapping[str, Sequence[HistoryEvent]]
) -> list[ClaimView]:
    """``views`` with every live claim whose copy waits for a lane slot marked ``"waiting"``.

    A copy is claimed before it waits for its lane, so the claim store alone shows it as
    running. The worker histories when a copy starts waiting for a full lane (``waiting``) and
    when it gets its slot (``lane_slot``): a live claim whose latest such event, for the same
    claim and fencing number, is ``waiting`` has not reached the pool.

    Args:
        views: claim views (any state; only ``running`` ones can change).
        histories: task id -> its history, oldest first
            (:meth:`~celery_claims.observe.history.History.read_many`).
    """
    marked = []
    for view in views:
        last = _waits_for_lane(view, histories)
        if last is not None and last.event == "rate_wait":
            view = replace(view, state="waiting", rate=last.reason)
        elif last is not None:
            # in a keyed lane the event names the key it waits for: `lane[key]`
            lane = f"{last.reason}[{last.other}]" if last.other else last.reason
            view = replace(view, state="waiting", lane=lane)
        marked.append(view)
    return marked


def _waits_for_lane(
    view: ClaimView, histories: Mapping[str, Sequence[HistoryEvent]]
) -> HistoryEvent | None:
    """The ``waiting`` (or ``rate_wait``) event of a live claim whose copy still waits for its
    lane (or its rate), else None."""
    if view.state != "running":
        return None
    last = None
    for event in histories.get(view.task_id, ()):
        if (
            event.event in ("waiting", "lane_slot", "rate_wait", "rate_pass")
            and event.claim_id == view.claim_id
            and event.instance == view.instance
        ):
            last = event
    return last if last is not None and last.event in ("waiting", "rate_wait") else None


def waiting_per_lane(
    views: Iterable[ClaimView], histories: Mapping[str, Sequence[HistoryEvent]]
) -> dict[str, int]:
    """How many copies wait for a slot of each lane (the live claims :func:`mark_waiting`
    marks, counted by lane name: a keyed lane's keys together).

    Args:
        views: the live claims (:func:`list_views`), not yet marked.
        histories: task id -> its history, oldest first.
    """
    return _waiting_per(views, histories, "waiting")


def waiting_per_rate(
    views: Iterable[ClaimView], histories: Mapping[str, Sequence[HistoryEvent]]
) -> dict[str, int]:
    """How many claimed copies wait for each fleet-wide rate (by the name of the limit that
    held them: ``task:<task>``, ``key:<task>:<key>``, ``lane:<lane>``...).

    Args:
        views: the live claims (:func:`list_views`), not yet marked.
        histories: task id -> its history, oldest first.
    """
    return _waiting_per(views, histories, "rate_wait")


def _waiting_per(
    views: Iterable[ClaimView], histories: Mapping[str, Sequence[HistoryEvent]], what: str
) -> dict[str, int]:
    """The live claims whose latest wait event (for that claim) is ``what``, counted by its
    reason (the lane's or the rate's name)."""
    counts: dict[str, int] = {}
    for view in views:
        event = _waits_for_lane(view, histories)
        if event is not None and event.event == what:
            counts[event.reason] = counts.get(event.reason, 0) + 1
    return counts


# --- what waits on a key ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyWaiter:
    """A copy waiting on a key: of a keyed task, or for its key's slot of a keyed lane.

    Attributes:
        task_id: the waiting task.
        waits_for: ``"key"`` (a keyed task's copy held unacked while another task holds its
            key: the ``wait`` policy) or ``"lane"`` (claimed, waiting for a slot of its
            key in a keyed lane).
        claim_id: its claim: the key's (``queue/<task or namespace>[<key>]``) for ``key``,
            its own for ``lane``.
        worker: where it waits: the worker node (``key``) or its claim's owner (``lane``).
        since_ms: epoch ms it was held (``key``, the worker's clock) or claimed (``lane``).
        holder: for ``key``, the owner holding the key when it was held; else empty.
        instance: for ``lane``, its claim's fencing number; else 0.
    """

    task_id: str
    waits_for: str
    claim_id: str
    worker: str
    since_ms: int
    holder: str = ""
    instance: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return asdict(self)


def _last_hold(events: Sequence[HistoryEvent], key: str) -> HistoryEvent | None:
    """The event that holds a copy on ``key`` if it still waits: its last hold for the key
    not followed by another event of that claim (it got the key, was skipped or released;
    a hold while the store was away leaves it waiting)."""
    hold = None
    for event in events:
        if event.event == "held" and event.key == key:
            hold = event
        elif hold is not None and event.claim_id == hold.claim_id and event.event != "held":
            hold = None
    return hold


def find_key_waiters(
    manager: RedisClaimManager,
    key: str,
    *,
    holders: Sequence[ClaimView] = (),
    queues: Sequence[str] | None = None,
    now_ms: int | None = None,
) -> list[KeyWaiter]:
    """The copies waiting on ``key``, oldest first: what the fleet's histories say.

    - A keyed task's copy held because another task holds ``key`` (the field
      ``<task or namespace>[<key>]``): the history indexes it under the key when it is held
      (:func:`~celery_claims.observe.history.key_waiters_key`); it waits while its own
      history's last event of that claim is the hold, and it is not the holder itself.
    - A message waiting for a slot of its key in a keyed lane (``key`` is then
      ``<lane>[<key>]``, as ``claims list`` shows the lane it waits for): claimed already, so
      found among the live claims of every known queue (:func:`mark_waiting`).

    Args:
        manager: the claim store.
        key: a keyed task's key field, or a keyed lane's ``<lane>[<key>]``.
        holders: the key's claims (:func:`find_key`): a holder never waits on its own key.
        queues: where to look (default: every known queue; a namespace is a queue of its own).
        now_ms: the time to judge leases by (default: the Redis server's clock).

    Raises:
        InvalidArgument: ``key`` is not a non-empty str.
        BackendUnavailable: Redis cannot be reached.
    """
    require_id("key", key)
    history = History(manager.client, manager.prefix)
    held = [v.task_id for v in holders if v.state in ("running", "expired", "waiting")]
    candidates = [task_id for task_id in history.waiters(key) if task_id not in held]
    queue_ids = list(manager.known_queues() if queues is None else queues)
    claim_ids = {f"{queue}/{key}" for queue in queue_ids}
    found: list[KeyWaiter] = []
    for task_id, events in history.read_many(candidates).items():
        hold = _last_hold(events, key)
        if hold is not None and hold.claim_id in claim_ids:
            found.append(
                KeyWaiter(task_id, "key", hold.claim_id, hold.worker, hold.at_ms, hold.other)
            )
    now = server_now_ms(manager.client) if now_ms is None else now_ms
    live = [view for queue in queue_ids for view in list_views(manager, queue, now)]
    live = mark_waiting(live, history.read_many(v.task_id for v in live))
    found += [
        KeyWaiter(v.task_id, "lane", v.claim_id, v.owner, v.since_ms, instance=v.instance)
        for v in live
        if v.state == "waiting" and v.lane == key
    ]
    return sorted(found, key=lambda w: (w.since_ms, w.task_id))


# --- lanes --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LaneOccupancy:
    """How full one lane is, per kind, fleet-wide.

    Attributes:
        lane: the lane key.
        kind: the task kind.
        active: tasks processing with a live lease (using the lane's slots).
        waiting: for a Celery lane (``claims_lanes``, see :func:`with_celery_lanes`), the
            messages claimed and waiting for a slot; for a lane of the lane store used
            directly, its tasks pending or due for a retry.
        limit: the lane's limit if known (from the configuration), else ``None``.
        keys: in a keyed lane, the keys with the most live leases and their counts, most
            first (at most ``top_keys`` of :func:`lane_occupancy`); empty otherwise.
    """

    lane: str
    kind: str
    active: int
    waiting: int
    limit: int | None = None
    keys: tuple[tuple[str, int], ...] = ()

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


def _processing_lanes(client: RedisClient, base: str) -> list[tuple[str, str]]:
    """Every (lane, kind) with a ``processing`` key, sorted: a ``SCAN``."""
    return sorted(
        {
            parsed
            for key in client.scan_iter(match=f"{base}*}}:processing:*", count=1000)
            if (parsed := _lane_of_key(_text(key), base)) is not None
        }
    )


def _lane_counts(
    client: RedisClient, base: str, found: Sequence[tuple[str, str]], now: int
) -> list[Any]:
    """Per (lane, kind) of ``found``, in turn: its live leases' members and its due count."""
    pipe = client.pipeline(transaction=False)
    for lane, kind in found:
        lane_base = f"{base}{escape(lane)}}}"
        # lane scores are epoch microseconds; a lease is live while its expiry is after now
        pipe.zrangebyscore(f"{lane_base}:processing:{escape(kind)}", f"({now * 1000}", "+inf")
        pipe.zcard(f"{lane_base}:due:{escape(kind)}")
    return pipe.execute() if found else []


def _lease_records(
    client: RedisClient, base: str, found: Sequence[tuple[str, str]], live: Sequence[Any]
) -> list[Any]:
    """The task records of the live leases, one list per (lane, kind) that has any."""
    pipe = client.pipeline(transaction=False)
    for (lane, _), members in zip(found, live, strict=True):
        if members:
            pipe.hmget(f"{base}{escape(lane)}}}:tasks", members)
    return pipe.execute() if any(live) else []


def lane_occupancy(
    client: RedisClient,
    prefix: str,
    *,
    now_ms: int | None = None,
    limits: Mapping[str, int] | None = None,
    top_keys: int = DEFAULT_TOP_KEYS,
) -> list[LaneOccupancy]:
    """Occupancy of every lane of the Redis lane store under ``prefix``.

    Lanes are found by a ``SCAN`` for their ``processing`` keys (an operator's read, not a hot
    path; a lane that never processed a task has no such key yet and is not listed). A keyed
    lane's per-key occupancy is read from its live leases' records (a second round trip; a
    lane holds at most ``limit`` live leases).

    Args:
        client: a Redis client.
        prefix: the lane store's key prefix.
        now_ms: the time leases are judged by (default: the Redis server's clock).
        limits: lane key -> limit, to show next to the counts.
        top_keys: how many keys of a keyed lane to report, those with the most live leases.

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
        found = _processing_lanes(client, base)
        counts = _lane_counts(client, base, found, now)
        live = counts[::2]
        records = iter(_lease_records(client, base, found, live))
    return [
        LaneOccupancy(
            lane,
            kind,
            len(members),
            int(waiting),
            (limits or {}).get(lane),
            _top_keys(next(records) if members else [], top_keys),
        )
        for (lane, kind), members, waiting in zip(found, live, counts[1::2], strict=True)
    ]


def with_celery_lanes(
    lanes: Sequence[LaneOccupancy], limits: Mapping[str, int], waiting: Mapping[str, int]
) -> list[LaneOccupancy]:
    """``lanes`` (from :func:`lane_occupancy`) with every lane of ``claims_lanes`` in it.

    A Celery lane's slots are tickets of the lane store (one kind, named as the lane) that
    workers give back and reuse: its pending records are idle tickets as often as waiting
    messages, so its ``waiting`` is replaced by the copies the history says wait for a slot
    (:func:`waiting_per_lane`). A configured lane that never ran a task has no key in the
    store: it is added, idle. Other lanes (the lane store used directly) are left as they are.

    Args:
        lanes: the store's occupancy.
        limits: the configured lanes, name -> limit.
        waiting: lane name -> copies waiting for a slot.

    Returns:
        Every lane, sorted by lane and kind.
    """
    rows = [
        replace(lane, waiting=waiting.get(lane.lane, 0))
        if lane.lane in limits and lane.kind == lane.lane
        else lane
        for lane in lanes
    ]
    seen = {(lane.lane, lane.kind) for lane in rows}
    rows += [
        LaneOccupancy(name, name, 0, waiting.get(name, 0), limit)
        for name, limit in limits.items()
        if (name, name) not in seen
    ]
    return sorted(rows, key=lambda lane: (lane.lane, lane.kind))


def _top_keys(records: Sequence[Any], top: int) -> tuple[tuple[str, int], ...]:
    """The ``top`` keys held by these lease records, with their counts, most first."""
    held: dict[str, int] = {}
    for raw in records:
        # a record the lease listing found but that went away since is simply not counted
        key = json.loads(_text(raw)).get("key") if raw is not None else None
        if isinstance(key, str):
            held[key] = held.get(key, 0) + 1
    return tuple(sorted(held.items(), key=lambda item: (-item[1], item[0]))[:top])


def lane_key_running(
    client: RedisClient, prefix: str, key: str, *, now_ms: int | None = None
) -> list[tuple[str, int]]:
    """The keyed lanes in which ``key`` (``<lane>[<key>]``) holds slots: ``(lane, live
    leases of the key)``; empty when no lane has it running.

    Raises:
        InvalidArgument: a bad prefix.
        BackendUnavailable: Redis cannot be reached.
    """
    # a lane holds at most `limit` live leases: asking for every key's count reads no more
    lanes = lane_occupancy(client, prefix, now_ms=now_ms, top_keys=2**31)
    return [
        (lane.lane, count)
        for lane in lanes
        for held, count in lane.keys
        if f"{lane.lane}[{held}]" == key
    ]


# --- the fleet at a glance ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetStats:
    """What ``celery claims stats`` prints and the store's exporter exports: one reading.

    Attributes:
        per_queue: each queue's counters (``RedisClaimManager.queue_stats``).
        live: each queue's live claims.
        lanes: every lane's occupancy, every configured lane included (:func:`with_celery_lanes`).
        rates: copies waiting for each fleet-wide rate (:func:`waiting_per_rate`).
    """

    per_queue: Mapping[str, Any]
    live: Mapping[str, int]
    lanes: Sequence[LaneOccupancy]
    rates: Mapping[str, int]


def fleet_stats(
    manager: RedisClaimManager,
    limits: Mapping[str, int],
    *,
    lanes: bool = True,
    top_keys: int = DEFAULT_TOP_KEYS,
) -> FleetStats:
    """Read the fleet's counters, live claims, lanes and rate waits from the store, once.

    A Celery lane's waiting messages and a rate's waiting copies are claimed already: the
    task history of the live claims tells them apart from running ones.

    Args:
        manager: the claim store.
        limits: the configured lanes (``claims_lanes``), name -> limit.
        lanes: read the lane store too (a ``SCAN``).
        top_keys: keys reported per keyed lane.
    """
    now = server_now_ms(manager.client)
    per_queue = manager.queue_stats()
    views = {q: list_views(manager, q, now) for q in per_queue}
    claimed = [view for found in views.values() for view in found]
    histories = History(manager.client, manager.prefix).read_many(v.task_id for v in claimed)
    occupancy: list[LaneOccupancy] = []
    if lanes:
        occupancy = lane_occupancy(
            manager.client, manager.prefix, now_ms=now, limits=limits, top_keys=top_keys
        )
        occupancy = with_celery_lanes(occupancy, limits, waiting_per_lane(claimed, histories))
    return FleetStats(
        per_queue=per_queue,
        live={q: len(found) for q, found in views.items()},
        lanes=occupancy,
        rates=waiting_per_rate(claimed, histories),
    )
