"""The publish journal's store: a copy of each published message until its task is settled.

A Redis broker can lose a message between the worker's ``BRPOP``, which takes it off the
queue, and kombu's write of the delivery to ``unacked`` (a second round trip): a consumer
killed in between leaves no copy anywhere. So the producer journals each message it publishes
in the claim store, and workers re-publish a journaled message whose task is neither done nor
claimed once its recover time has passed (:mod:`celery_claims.worker.publish`). This module
is the store half, with no Celery in it: one script per operation, every key under the queue's
hash tag (:class:`~celery_claims.claims.keys.QueueKeys`):

- ``{q}:j`` hash, task id -> the message (an opaque string: the Celery layer's envelope);
- ``{q}:jt`` sorted set, task id -> the time (ms, the server's clock) after which recovery
  may act on it;
- ``{q}:jn`` hash, task id -> how many times recovery has re-published it;
- ``{q}:jl`` the scan lock (``SET NX PX``: one worker scans a queue at a time).

An entry goes only when its task is over: cleared by a worker once the attempt is recorded
done (or given up), or ended for good without a record (failed, rejected, revoked, refused), or
dropped by recovery (done, expired, undecodable, re-published too often). While it is there and
a live lease holds the task, the two are the task's durable copy (:meth:`RedisJournal.held_call`).

Times come from the Redis server's clock, like claim expiries: a producer or worker whose own
clock is off neither delays nor hastens recovery.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from types import MappingProxyType
from typing import Any

from redis.commands.core import Script

from celery_claims.claims.calls import RedisClient, ScriptCall, translate_errors
from celery_claims.claims.keys import DEFAULT_PREFIX, QueueKeys, require_prefix
from celery_claims.claims.scripts import script_source
from celery_claims.errors import BackendError, InvalidArgument
from celery_claims.model import AlreadyClaimed
from celery_claims.validation import require_id, require_ms

__all__ = ["Held", "JournalEntry", "RedisJournal"]

#: Most entries one :meth:`RedisJournal.take_due` call returns (bounds a scan's time).
MAX_TAKE = 1000


@cache
def _source(name: str) -> str:
    return (resources.files("celery_claims.claims") / "lua" / f"{name}.lua").read_text("utf-8")


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class Held(enum.IntEnum):
    """What ``journal_held.lua`` found (:meth:`RedisJournal.held_call`): its status codes."""

    #: no live claim of another owner holds the task (none, an expired one, the asker's own)
    NOT_HELD = 0
    #: another owner's live lease holds the task, and its message is journaled
    JOURNALED = 1
    #: another owner's live lease holds the task; its message is not journaled
    NOT_JOURNALED = 2


def _held(reply: Any) -> tuple[Held, AlreadyClaimed | None]:
    """``journal_held.lua``'s reply: the status, and the holder where one holds the task."""
    code = int(reply[0]) if reply else -1
    if code == Held.NOT_HELD:
        return Held.NOT_HELD, None
    if code in (Held.JOURNALED, Held.NOT_JOURNALED):
        return Held(code), AlreadyClaimed(_text(reply[1]), int(reply[2]))
    raise BackendError(f"journal_held.lua answered an unknown status: {reply!r:.80}")


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One journaled message taken for recovery.

    Attributes:
        queue_id: its queue.
        task_id: the claim store's task id of its attempt (``<task id>:<retries>:<nesting>``).
        message: what the producer journaled.
        republished: how many times recovery has re-published it so far.
        now_ms: the store's time when it was taken.
    """

    queue_id: str
    task_id: str
    message: str
    republished: int
    now_ms: int


class RedisJournal:
    """The publish journal on a Redis (standalone or Cluster) client.

    Args:
        client: the claim store's client (``decode_responses`` on or off).
        prefix: the claim store's key prefix.

    Raises:
        InvalidArgument: a bad prefix.
    """

    def __init__(self, *, client: RedisClient, prefix: str = DEFAULT_PREFIX) -> None:
        self.client = client
        self.prefix = require_prefix(prefix)
        self._put: Script = client.register_script(_source("journal_put"))
        self._take: Script = client.register_script(_source("journal_take"))
        self._forget: Script = client.register_script(_source("journal_forget"))
        # it reads a claim entry: the claim scripts' preamble (its parser) comes with it
        self._held: Script = client.register_script(script_source("journal_held"))
        self._keys: dict[str, QueueKeys] = {}

    @property
    def scripts(self) -> Mapping[str, Script]:
        """The registered scripts by operation name (``journal_put``, ``journal_take``,
        ``journal_forget``, ``journal_held``)."""
        return MappingProxyType(
            {
                "journal_put": self._put,
                "journal_take": self._take,
                "journal_forget": self._forget,
                "journal_held": self._held,
            }
        )

    def keys(self, queue_id: str) -> QueueKeys:
        """The key names of ``queue_id``."""
        keys = self._keys.get(queue_id) if isinstance(queue_id, str) else None
        if keys is None:
            keys = QueueKeys(self.prefix, require_id("queue_id", queue_id))
            if len(self._keys) >= 1024:
                self._keys.clear()
            self._keys[queue_id] = keys
        return keys

    def put_call(
        self,
        queue_id: str,
        task_id: str,
        message: str,
        *,
        recover_after_ms: int,
        eta_ms: int | None = None,
        keep: bool = False,
    ) -> ScriptCall[int]:
        """The checked, unsent journal write of ``message`` (one script, one round trip).

        Its recover time is ``recover_after_ms`` after now, or after ``eta_ms`` when that is
        later; the call's result is that time. ``keep``: an entry of ``task_id`` already
        there keeps its message and re-publish count, and its recover time unless
        ``recover_after_ms`` after now is sooner.

        Raises:
            InvalidArgument: a bad id, message, delay or ETA.
        """
        keys = self.keys(queue_id)
        require_id("task_id", task_id)
        if not isinstance(message, str) or not message:
            raise InvalidArgument("message", "must be a non-empty str")
        require_ms("recover_after_ms", recover_after_ms, maximum=2**31 - 1)
        if eta_ms is not None and (
            isinstance(eta_ms, bool) or not isinstance(eta_ms, int) or eta_ms < 0
        ):
            raise InvalidArgument("eta_ms", f"must be epoch ms or None, got {eta_ms!r:.80}")
        args: list[Any] = [task_id, message, recover_after_ms, "" if eta_ms is None else eta_ms]
        return ScriptCall(self._put, keys.journal_keys, [*args, "keep"] if keep else args, int)

    def put(
        self,
        queue_id: str,
        task_id: str,
        message: str,
        *,
        recover_after_ms: int,
        eta_ms: int | None = None,
        keep: bool = False,
    ) -> int:
        """Journal ``message`` (see :meth:`put_call`); returns its recover time.

        Raises:
            InvalidArgument: as :meth:`put_call`.
            BackendUnavailable: the store could not be reached.
        """
        call = self.put_call(
            queue_id, task_id, message, recover_after_ms=recover_after_ms, eta_ms=eta_ms, keep=keep
        )
        with translate_errors():
            return call.decode(call.script(keys=call.keys, args=call.args))

    def publish_call(
        self,
        queue_id: str,
        task_id: str,
        list_key: str,
        payload: str,
        *,
        recover_after_ms: int,
        eta_ms: int | None = None,
    ) -> ScriptCall[int]:
        """The checked, unsent push of ``payload`` to ``list_key`` with its journal entry, in
        one script, the push first: a Redis broker's publish (``payload``: kombu's message as
        its Redis transport pushes it) and its entry in one step. The entry is ``payload``
        itself; its recover time and the call's result as in :meth:`put_call`.

        For a store that is the broker's own server and database (standalone: the broker's
        list and the journal's keys are in different slots).

        Raises:
            InvalidArgument: a bad id, list key, payload, delay or ETA.
        """
        put = self.put_call(
            queue_id, task_id, payload, recover_after_ms=recover_after_ms, eta_ms=eta_ms
        )
        require_id("list_key", list_key)
        return ScriptCall(put.script, [*put.keys, list_key], put.args, put.decode)

    def take_due(self, queue_id: str, *, limit: int, defer_ms: int) -> list[JournalEntry]:
        """The entries whose recover time has passed, at most ``limit``, oldest first.

        Each one taken has its recover time pushed ``defer_ms`` forward in the same script,
        so another scan does not take it again before then.

        Raises:
            InvalidArgument: a bad queue, limit or delay.
            BackendUnavailable: the store could not be reached.
        """
        keys = self.keys(queue_id)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_TAKE:
            raise InvalidArgument("limit", f"must be an int in 1..{MAX_TAKE}, got {limit!r:.80}")
        require_ms("defer_ms", defer_ms, maximum=2**31 - 1)
        with translate_errors():
            reply = self._take(keys=keys.journal_keys, args=[limit, defer_ms])
        if not reply:
            raise BackendError("journal_take.lua answered nothing")
        now = int(reply[0])
        rest = reply[1:]
        return [
            JournalEntry(queue_id, _text(task), _text(message), int(count), now)
            for task, message, count in zip(rest[::3], rest[1::3], rest[2::3], strict=True)
        ]

    def forget(self, queue_id: str, task_ids: Iterable[str]) -> None:
        """Remove the entries of ``task_ids`` (one pipelined round trip; absent ones are fine).

        Raises:
            BackendUnavailable: the store could not be reached.
        """
        keys = self.keys(queue_id)
        ids = sorted(set(task_ids))
        if not ids:
            return
        with translate_errors():
            pipe = self.client.pipeline(transaction=False)
            pipe.hdel(keys.journal, *ids)
            pipe.zrem(keys.journal_due, *ids)
            pipe.hdel(keys.journal_republished, *ids)
            pipe.execute()

    def forget_call(self, queue_id: str, task_ids: Iterable[str]) -> ScriptCall[int]:
        """The checked, unsent removal of the entries of ``task_ids`` (one script; absent
        ones are fine); its result is how many there were.

        Raises:
            InvalidArgument: a bad id, or no id at all.
        """
        keys = self.keys(queue_id)
        ids = sorted({require_id("task_id", task_id) for task_id in task_ids})
        if not ids:
            raise InvalidArgument("task_ids", "must name at least one task")
        return ScriptCall(self._forget, keys.journal_keys, ids, int)

    def held_call(
        self, queue_id: str, task_id: str, owner: str
    ) -> ScriptCall[tuple[Held, AlreadyClaimed | None]]:
        """The checked, unsent question "does another owner's live lease hold ``task_id``,
        and is its message journaled?", both read in one script (``journal_held.lua``).

        Its result is :attr:`Held.JOURNALED` or :attr:`Held.NOT_JOURNALED` with the holder
        (its owner and lease expiry), or :attr:`Held.NOT_HELD` with None (no claim, an
        expired one, or ``owner``'s own). A task acknowledged at claim that is
        :attr:`Held.JOURNALED` has a durable copy besides any message: if its holder dies,
        recovery publishes the entry again once the lease has run out.

        Raises:
            InvalidArgument: a bad queue, task id or owner.
        """
        keys = self.keys(queue_id)
        require_id("task_id", task_id)
        require_id("owner", owner)
        return ScriptCall(
            self._held, [keys.claims, keys.owners, keys.journal], [task_id, owner, ""], _held
        )

    def count_republished(self, queue_id: str, task_id: str) -> int:
        """Count one more re-publish of ``task_id``'s message; returns the new count.

        Raises:
            BackendUnavailable: the store could not be reached.
        """
        keys = self.keys(queue_id)
        with translate_errors():
            return int(self.client.hincrby(keys.journal_republished, task_id, 1))

    def lock(self, queue_id: str, owner: str, ttl_ms: int) -> bool:
        """Take the queue's scan lock for ``ttl_ms`` unless another worker holds it.

        The lock is never released: it expires, so a queue is scanned at most once per
        ``ttl_ms`` across the fleet, and a scanner that dies leaves it for at most that long.

        Raises:
            BackendUnavailable: the store could not be reached.
        """
        keys = self.keys(queue_id)
        require_id("owner", owner)
        require_ms("ttl_ms", ttl_ms, maximum=2**31 - 1)
        with translate_errors():
            return bool(self.client.set(keys.journal_lock, owner, nx=True, px=max(ttl_ms, 1)))

    def entries(self, queue_id: str) -> dict[str, tuple[str, int]]:
        """Every entry of ``queue_id``: task id -> (message, recover time ms); for operators
        and tests (two round trips, the whole hash: not for hot paths).

        Raises:
            BackendUnavailable: the store could not be reached.
        """
        keys = self.keys(queue_id)
        with translate_errors():
            messages = self.client.hgetall(keys.journal)
            times = self.client.zrange(keys.journal_due, 0, -1, withscores=True)
        due = {_text(pair[0]): int(pair[1]) for pair in times}
        return {_text(t): (_text(m), due.get(_text(t), 0)) for t, m in messages.items()}
