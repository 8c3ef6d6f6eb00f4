"""The Redis lane store: tasks and lane state in Redis, one Lua script per lane claim.

Each lane's keys share the lane's hash tag (see :mod:`celery_claims.lanes.keys`), so every
script runs on one Redis Cluster slot. ``claim_candidates_for_lane`` is one script and one
round trip per batch: it recounts the lane's live leases at ``claimed_at``, walks the candidates
in order and claims each by compare-and-swap until the lane is full.

Times are stored as epoch microseconds, exact in a sorted-set score (below 2**53) and in a
``datetime``. Tokens are stored and compared as decimal strings, since Lua numbers are doubles
and cannot hold a 64-bit token. Every redis-py error is raised as
:class:`~celery_claims.errors.IoError` with the driver error as its ``__cause__``.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timedelta, timezone
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script

from celery_claims.connection import close as close_client
from celery_claims.connection import connect
from celery_claims.errors import (
    CodecError,
    InvalidArgument,
    InvalidValueError,
    IoError,
    TaskCoreError,
    TaskNotFound,
)
from celery_claims.lanes import _validate as check
from celery_claims.lanes.dispatch import Clock, utc_now
from celery_claims.lanes.keys import LaneKeys, member, task_index_key
from celery_claims.lanes.model import (
    MAX_TASK_ID,
    ClaimedTask,
    StoreStatus,
    TaskClaimCandidate,
    TaskLaneConfig,
    TaskRecord,
    TaskStatus,
    raise_for_status,
)
from celery_claims.validation import require_prefix

__all__ = ["DEFAULT_PREFIX", "RedisTaskClaimStore"]

#: The default first part of every key the store writes.
DEFAULT_PREFIX = "claims"

#: How many task ids a store remembers the lane and kind of (saving the id index lookup).
LOCATION_CACHE_SIZE = 65_536

#: The most records one ``lane_purge`` script reads and removes (``purge_stale`` loops).
PURGE_BATCH = 100

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)

RedisClient = redis.Redis | redis.RedisCluster


def to_us(value: datetime) -> int:
    """A tz-aware datetime as integer epoch microseconds (exact)."""
    return (value - _EPOCH) // _MICROSECOND


def from_us(value: int) -> datetime:
    """Integer epoch microseconds as a UTC datetime (exact)."""
    return _EPOCH + value * _MICROSECOND


def _text(value: object) -> str:
    # The client may or may not decode responses; the store works either way.
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, str):
        return value
    raise CodecError(f"expected a string reply from Redis, got {value!r}")


def _load_script(client: RedisClient, name: str) -> Script:
    lua = resources.files("celery_claims.lanes").joinpath("lua")
    # every script starts with the shared preamble: status codes and the ownership check
    source = (
        lua.joinpath("_common.lua").read_text() + "\n" + lua.joinpath(f"{name}.lua").read_text()
    )
    return client.register_script(source)


@contextlib.contextmanager
def _driver_errors(operation: str) -> Iterator[None]:
    try:
        yield
    except redis.RedisError as exc:
        raise IoError(f"redis lane store: {operation} failed: {exc}") from exc


def encode_record(record: TaskRecord[str]) -> str:
    """The JSON form of a task record in a lane's hash (every value a string, see above)."""
    return json.dumps(
        {
            "kind": record.kind,
            "status": record.status.value,
            "token": str(record.processing_token),
            "next_run_at_us": str(to_us(record.next_run_at)),
            "lease_expires_at_us": (
                "" if record.lease_expires_at is None else str(to_us(record.lease_expires_at))
            ),
            "claimed_at_us": "" if record.claimed_at is None else str(to_us(record.claimed_at)),
            "payload": record.payload,
        },
        separators=(",", ":"),
    )


def decode_record(task_member: object, raw: object) -> TaskRecord[str]:
    """A task record from its member and the JSON a lane's hash holds.

    Raises:
        CodecError: the stored record is not one this store wrote.
    """
    try:
        task_id = int(_text(task_member))
        fields = json.loads(_text(raw))
        lease = fields["lease_expires_at_us"]
        claimed = fields["claimed_at_us"]
        record = TaskRecord(
            id=task_id,
            kind=str(fields["kind"]),
            status=TaskStatus(fields["status"]),
            processing_token=int(fields["token"]),
            next_run_at=from_us(int(fields["next_run_at_us"])),
            lease_expires_at=from_us(int(lease)) if lease else None,
            claimed_at=from_us(int(claimed)) if claimed else None,
            payload=str(fields["payload"]),
        )
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        raise CodecError(f"undecodable lane task record {raw!r}: {exc}") from exc
    if not 0 <= task_id <= MAX_TASK_ID:
        raise CodecError(f"lane task member out of range: {task_member!r}")
    return record


class RedisTaskClaimStore:
    """A lane store in Redis or Redis Cluster.

    Args:
        url: a store URL in any form :func:`celery_claims.connect` takes, for a
            client the store creates (and closes in :meth:`close`).
        client: a ``redis.Redis`` or ``redis.RedisCluster`` to use; either decoding mode works.
        lanes: the lanes the store serves; kinds and lane keys are non-empty ``str``.
        prefix: the first part of every key (no braces).
        clock: the time source of ``enqueue``'s default ``next_run_at``.

    Raises:
        InvalidValueError: on a bad argument (both or neither of ``url`` and ``client``, a kind
            in two lanes, ...).
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        client: RedisClient | None = None,
        lanes: Iterable[TaskLaneConfig[str, Any]],
        prefix: str = DEFAULT_PREFIX,
        clock: Clock = utc_now,
    ) -> None:
        if (url is None) == (client is None):
            raise InvalidValueError("pass exactly one of url= and client=")
        self._lanes: check.LaneRegistry[str, Any] = check.LaneRegistry(lanes, str_kinds=True)
        self.prefix = require_prefix(prefix, error=InvalidValueError)
        self._clock = clock
        self._owns_client = client is None
        if client is None:
            if not isinstance(url, str):
                raise InvalidValueError(f"url must be a str, got {url!r}")
            try:
                client = connect(url)
            except InvalidArgument as exc:
                raise InvalidValueError(f"not a Redis URL: {exc}") from exc
        self.client: RedisClient = client
        self._index = task_index_key(self.prefix)
        # A task's lane and kind never change once its id is indexed, so they can be cached:
        # complete/retry/heartbeat of a task this process enqueued or claimed is one round trip.
        self._locations: dict[int, tuple[str, str]] = {}
        self._locations_lock = threading.Lock()
        self._enqueue = _load_script(client, "lane_enqueue")
        self._list = _load_script(client, "lane_list")
        self._claim = _load_script(client, "lane_claim")
        self._complete = _load_script(client, "lane_complete")
        self._retry = _load_script(client, "lane_retry")
        self._heartbeat = _load_script(client, "lane_heartbeat")
        self._purge = _load_script(client, "lane_purge")

    def close(self) -> None:
        """Close the client if the store created it from ``url=``."""
        if self._owns_client:
            close_client(self.client)

    def lane_keys(self, lane_key: str) -> LaneKeys:
        """The keys of the lane named ``lane_key`` (for inspection and tests)."""
        return LaneKeys(self.prefix, lane_key)

    def _keys_of_kind(self, kind: str) -> LaneKeys:
        return self.lane_keys(self._lanes.lane_for_kind(kind).lane_key)

    def _remember(self, task_id: int, lane_key: str, kind: str) -> None:
        with self._locations_lock:
            if len(self._locations) >= LOCATION_CACHE_SIZE:
                # Forget the oldest entry (dicts keep insertion order).
                del self._locations[next(iter(self._locations))]
            self._locations[task_id] = (lane_key, kind)

    def _forget(self, task_ids: Sequence[int]) -> None:
        with self._locations_lock:
            for task_id in task_ids:
                self._locations.pop(task_id, None)

    def _locate(self, task_id: int) -> tuple[LaneKeys, str] | None:
        """The lane keys and kind of a task, from the id index; ``None`` for an unknown id."""
        known = self._locations.get(task_id)
        if known is None:
            with _driver_errors("task lookup"):
                raw = self.client.hget(self._index, str(task_id))
            if raw is None:
                return None
            known = _index_entry(raw)
            self._remember(task_id, *known)
        lane_key, kind = known
        return self.lane_keys(lane_key), kind

    def _found(self, task_id: int) -> tuple[LaneKeys, str]:
        """The lane keys and kind of a task of this store; :class:`TaskNotFound` otherwise."""
        located = self._locate(task_id)
        if located is None:
            raise TaskNotFound(task_id)
        return located

    def _settle(
        self, operation: str, script: Script, task_id: int, token: int, keys: list[str], *args: int
    ) -> bool:
        """Run a complete, retry or heartbeat ``script`` on the attempt's task; its outcome."""
        with _driver_errors(operation):
            reply = script(keys=keys, args=[member(task_id), str(token), *args])
        return raise_for_status(_status(reply), task_id=task_id, processing_token=token)

    # --- producer and worker operations ---------------------------------------------------

    def enqueue(
        self,
        task_id: int,
        kind: str,
        *,
        next_run_at: datetime | None = None,
        payload: str = "",
    ) -> TaskRecord[str]:
        """Add a pending task; see :meth:`MemoryTaskClaimStore.enqueue`.

        Two round trips: the id index (another slot) first, then the lane's script. An
        enqueue interrupted between them leaves only the index entry, and repeating it
        completes it.
        """
        lane, record = self._lanes.new_task(task_id, kind, next_run_at, payload, self._clock)
        keys = self.lane_keys(lane.lane_key)
        entry = json.dumps([lane.lane_key, kind])
        with _driver_errors("enqueue"):
            if not self.client.hsetnx(self._index, str(task_id), entry):
                # Taken by this very task means an earlier enqueue died half-way: finish it.
                existing = self.client.hget(self._index, str(task_id))
                if existing is None or _index_entry(existing) != (lane.lane_key, kind):
                    raise_for_status(StoreStatus.EXISTS, task_id=task_id)
            reply = self._enqueue(
                keys=[keys.tasks, keys.due(kind)],
                args=[member(task_id), encode_record(record), to_us(record.next_run_at)],
            )
        raise_for_status(_status(reply), task_id=task_id)
        self._remember(task_id, lane.lane_key, kind)
        return record

    def get_task(self, task_id: int) -> TaskRecord[str] | None:
        """The task with this id, or ``None``."""
        check.task_id(task_id)
        located = self._locate(task_id)
        if located is None:
            return None
        keys, _ = located
        with _driver_errors("get_task"):
            raw = self.client.hget(keys.tasks, member(task_id))
        return None if raw is None else decode_record(member(task_id), raw)

    def complete(self, task_id: int, processing_token: int) -> bool:
        """Mark the task done; see :meth:`MemoryTaskClaimStore.complete`."""
        check.attempt(task_id, processing_token)
        keys, kind = self._found(task_id)
        lane_keys = [keys.tasks, keys.processing(kind)]
        return self._settle("complete", self._complete, task_id, processing_token, lane_keys)

    def retry(self, task_id: int, processing_token: int, *, next_run_at: datetime) -> None:
        """Give the task back for another attempt; see :meth:`MemoryTaskClaimStore.retry`."""
        check.attempt(task_id, processing_token)
        due = check.utc("next_run_at", next_run_at)
        keys, kind = self._found(task_id)
        lane_keys = [keys.tasks, keys.due(kind), keys.processing(kind)]
        self._settle("retry", self._retry, task_id, processing_token, lane_keys, to_us(due))

    def heartbeat(self, task_id: int, processing_token: int, *, lease_expires_at: datetime) -> None:
        """Renew the attempt's lease; see :meth:`MemoryTaskClaimStore.heartbeat`."""
        check.attempt(task_id, processing_token)
        lease = check.utc("lease_expires_at", lease_expires_at)
        keys, kind = self._found(task_id)
        lane_keys = [keys.tasks, keys.processing(kind)]
        self._settle(
            "heartbeat", self._heartbeat, task_id, processing_token, lane_keys, to_us(lease)
        )

    def heartbeat_many(
        self, leases: Sequence[tuple[int, int]], *, lease_expires_at: datetime
    ) -> list[TaskCoreError | None]:
        """Renew many attempts' leases to ``lease_expires_at`` in one pipelined round trip.

        Each ``(task_id, processing_token)`` gets what :meth:`heartbeat` would do to it; a
        refused one yields its error (``LeaseLost``, ``TaskNotFound`` for an unknown id)
        in the result instead of raising, so one lost lease does not hide the others.
        (redis-py checks the script is loaded with one ``SCRIPT EXISTS`` per pipeline.)

        Raises:
            InvalidValueError: a malformed id, token or time (nothing is renewed).
            IoError: Redis failed.
        """
        lease = check.utc("lease_expires_at", lease_expires_at)
        checked = [(check.task_id(t), check.token(n)) for t, n in leases]
        located = [self._locate(task_id) for task_id, _ in checked]
        results: list[TaskCoreError | None] = [None] * len(checked)
        calls: list[int] = []
        with _driver_errors("heartbeat_many"):
            pipe = self.client.pipeline(transaction=False)
            for i, ((task_id, token), where) in enumerate(zip(checked, located, strict=True)):
                if where is None:
                    results[i] = TaskNotFound(task_id)
                    continue
                keys, kind = where
                self._heartbeat(
                    keys=[keys.tasks, keys.processing(kind)],
                    args=[member(task_id), str(token), to_us(lease)],
                    client=pipe,
                )
                calls.append(i)
            replies = pipe.execute() if calls else []
        for i, reply in zip(calls, replies, strict=True):
            task_id, token = checked[i]
            try:
                raise_for_status(_status(reply), task_id=task_id, processing_token=token)
            except TaskCoreError as exc:
                results[i] = exc
        return results

    def count_unfinished(self, kinds: Sequence[str]) -> int:
        """How many tasks of ``kinds`` are pending, retry or processing."""
        wanted = self._lanes.check_kinds(kinds)
        with _driver_errors("count_unfinished"):
            pipe = self.client.pipeline(transaction=False)
            for kind in wanted:
                keys = self._keys_of_kind(kind)
                pipe.zcard(keys.due(kind))
                pipe.zcard(keys.processing(kind))
            return sum(int(n) for n in pipe.execute())

    def purge_stale(
        self, lane_config: TaskLaneConfig[str, Any], *, stale_before: datetime, limit: int
    ) -> list[int]:
        """Delete the lane's records that nobody claimed, retried or renewed since
        ``stale_before``: pending and retry ones due before it, processing ones whose lease
        expired before it. Done records are kept.

        This drops tasks that are still claimable, so it is for records that only their
        creator would ever claim again: the Celery worker's lane tickets
        (:mod:`celery_claims.worker.delivery.lanes`), never a lane of real tasks. Each batch of at
        most :data:`PURGE_BATCH` records is one script that re-reads every record it removes, so a
        record claimed or renewed meanwhile is kept; the id index entries of the removed
        records are deleted after each batch (another slot, another round trip).

        Args:
            lane_config: a lane of this store.
            stale_before: the cutoff; at most the store clock's now (a live lease stays).
            limit: the most records to remove in this call.

        Returns:
            The ids of the records removed.

        Raises:
            InvalidValueError: on a bad argument (nothing is removed).
            IoError: Redis failed.
        """
        lane = self._lanes.registered(lane_config)
        cutoff = check.utc("stale_before", stale_before)
        most = check.non_negative_int("limit", limit)
        if cutoff > self._clock():
            raise InvalidValueError("stale_before must not be after now")
        keys = self.lane_keys(lane.lane_key)
        purged: list[int] = []
        while len(purged) < most:
            batch = min(PURGE_BATCH, most - len(purged))
            with _driver_errors("purge_stale"):
                reply = self._purge(keys=keys.of_kinds(lane.kinds), args=[to_us(cutoff), batch])
                raise_for_status(_status(reply), task_id=-1, lane=lane.lane)
                removed = [int(_text(item)) for item in reply[1:]]
                if removed:
                    self.client.hdel(self._index, *(str(task_id) for task_id in removed))
            self._forget(removed)
            purged.extend(removed)
            if len(removed) < batch:
                break
        return purged

    # --- TaskClaimStore ---------------------------------------------------------------------

    def list_claimable_by_kinds(
        self, now: datetime, stale_before: datetime, kinds: Sequence[str], limit: int
    ) -> list[TaskRecord[str]]:
        """List at most ``limit`` claimable tasks of ``kinds``, most overdue first.

        One script per lane the kinds belong to (one in the usual case of a lane's own kinds).
        """
        at, _ = check.listing_times(now, stale_before)
        wanted = self._lanes.check_kinds(kinds)
        count = check.non_negative_int("limit", limit)
        if count == 0:
            return []
        by_lane: dict[str, list[str]] = {}
        for kind in dict.fromkeys(wanted):
            by_lane.setdefault(self._lanes.lane_for_kind(kind).lane_key, []).append(kind)
        found: list[TaskRecord[str]] = []
        for lane_key, lane_kinds in by_lane.items():
            keys = self.lane_keys(lane_key)
            with _driver_errors("list_claimable_by_kinds"):
                reply = self._list(keys=keys.of_kinds(lane_kinds), args=[to_us(at), count])
            found.extend(decode_record(reply[i], reply[i + 1]) for i in range(0, len(reply), 2))
        found.sort(key=lambda task: (task.due_at(), task.id))
        return found[:count]

    def count_active_processing_by_kinds(self, now: datetime, kinds: Sequence[str]) -> int:
        """Count the tasks of ``kinds`` whose lease is live at ``now``."""
        at = check.utc("now", now)
        wanted = self._lanes.check_kinds(kinds)
        after = f"({to_us(at)}"
        with _driver_errors("count_active_processing_by_kinds"):
            pipe = self.client.pipeline(transaction=False)
            for kind in dict.fromkeys(wanted):
                pipe.zcount(self._keys_of_kind(kind).processing(kind), after, "+inf")
            return sum(int(n) for n in pipe.execute())

    def claim_candidates_for_lane(
        self,
        lane_config: TaskLaneConfig[str, Any],
        candidates: Sequence[TaskClaimCandidate],
        stale_before: datetime,
        claimed_at: datetime,
        lease_expires_at: datetime,
        *,
        keys: Sequence[str] | None = None,
        limit_per_key: int = 0,
    ) -> list[ClaimedTask]:
        """Claim candidates in order until the lane is full: one script, one round trip.

        A keyed pass (``keys``, one per candidate, and ``limit_per_key`` >= 1) also counts the
        lane's live leases per key, in the same script, and skips a candidate whose key holds
        ``limit_per_key`` of them already (a skipped candidate uses no capacity). The key is
        kept in the claimed record while its lease lives and dropped by ``retry`` and
        ``complete``: an idle key leaves nothing in Redis.

        Raises:
            InvalidValueError: on a bad argument, a lane this store does not serve, or a
                candidate that is not a task of the lane; nothing is claimed.
            IoError: Redis failed.
        """
        lane = self._lanes.registered(lane_config)
        checked = check.candidates(candidates)
        _, at, lease = check.claim_window(stale_before, claimed_at, lease_expires_at)
        candidate_keys = check.candidate_keys(keys, len(checked), limit_per_key, lane_config.limit)
        if not checked:
            return []
        lane_keys = self.lane_keys(lane.lane_key)
        args = _claim_args(
            to_us(at),
            to_us(lease),
            lane_config.limit,
            limit_per_key,
            lane.kinds,
            list(zip(checked, candidate_keys, strict=True)),
        )
        with _driver_errors("claim_candidates_for_lane"):
            reply = self._claim(keys=lane_keys.of_kinds(lane.kinds), args=args)
        return self._claimed(reply, lane, checked)

    def _claimed(
        self,
        reply: Any,
        lane: TaskLaneConfig[str, Any],
        checked: Sequence[TaskClaimCandidate],
    ) -> list[ClaimedTask]:
        """The lane claim script's reply as the tasks it claimed, each remembered in its lane."""
        status = _status(reply)
        # On NOT_FOUND the script names the position of the candidate it refused.
        failed = -1
        if status == StoreStatus.NOT_FOUND and len(reply) > 1:
            failed = checked[int(reply[1]) - 1].task_id
        raise_for_status(status, task_id=failed, lane=lane.lane)
        result: list[ClaimedTask] = []
        for i in range(1, len(reply), 2):
            candidate = checked[int(reply[i]) - 1]
            self._remember(candidate.task_id, lane.lane_key, lane.kinds[int(reply[i + 1]) - 1])
            result.append(
                ClaimedTask(candidate.index, candidate.task_id, candidate.next_processing_token)
            )
        return result


def _claim_args(
    at_us: int,
    lease_us: int,
    limit: int,
    limit_per_key: int,
    kinds: Sequence[str],
    candidates: Sequence[tuple[TaskClaimCandidate, str]],
) -> list[str | int]:
    """The ARGV of ``lane_claim.lua`` (its header lists them): the times, the limits, the
    lane's kinds (counted), then per (candidate, key) its member, tokens and key."""
    args: list[str | int] = [at_us, lease_us, limit, limit_per_key, len(kinds), *kinds]
    for candidate, key in candidates:
        args.extend(
            (
                member(candidate.task_id),
                str(candidate.expected_processing_token),
                str(candidate.next_processing_token),
                key,
            )
        )
    return args


def _index_entry(raw: object) -> tuple[str, str]:
    """The ``(lane key, kind)`` of an id index entry."""
    try:
        lane_key, kind = json.loads(_text(raw))
    except (ValueError, TypeError) as exc:
        raise CodecError(f"undecodable lane index entry {raw!r}") from exc
    return str(lane_key), str(kind)


def _status(reply: object) -> int:
    if not isinstance(reply, list) or not reply or not isinstance(reply[0], int):
        raise CodecError(f"unexpected lane script reply {reply!r}")
    return reply[0]
