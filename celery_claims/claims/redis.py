"""``RedisClaimManager``: the claim store of record, one Lua script and one round trip per call.

Expiry is judged by the Redis server's clock (``TIME`` inside each script), so every worker
agrees on it whatever its own clock says; a ``clock=`` callable sends the caller's time instead
(tests under freezegun). Works with standalone Redis and Redis Cluster clients, with
``decode_responses`` on or off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any, Generic, TypeAlias, TypeVar

import redis
import redis.exceptions as redis_errors
from redis.commands.core import Script

from celery_claims.claims.keys import DEFAULT_PREFIX, QueueKeys, queues_key, require_prefix
from celery_claims.claims.scripts import MANY_OPS, script_source
from celery_claims.claims.status import token_error
from celery_claims.clock import Clock
from celery_claims.connection import close as close_client
from celery_claims.connection import connect
from celery_claims.connection import parse as parse_store
from celery_claims.errors import (
    BackendError,
    BackendUnavailable,
    ClaimError,
    ClaimTokenError,
    InsufficientReplicas,
    InvalidArgument,
)
from celery_claims.model import (
    DEFAULT_GIVEN_UP_TTL_MS,
    AlreadyClaimed,
    AlreadyDone,
    ClaimResult,
    ClaimStats,
    ClaimStatus,
    ClaimToken,
    GateResult,
    GivenUp,
    Success,
    TookOver,
)
from celery_claims.validation import (
    require_id,
    require_limit,
    require_max_takeovers,
    require_ms,
    require_token,
    require_tokens,
)

__all__ = ["ManyPart", "RedisClaimManager", "RedisClient", "ScriptCall", "StoredTask", "many_call"]

_T = TypeVar("_T")

#: A standalone or cluster redis-py client.
RedisClient: TypeAlias = "redis.Redis | redis.RedisCluster"

#: Entries of each hash one ``cleanup_expired`` script call examines; bounds its run time.
CLEANUP_BATCH = 500

#: A ``cleanup_expired`` run with a limit examines at most this many entries of each hash of a
#: queue per claim it may remove (with the defaults, 200,000 per run of each hash).
SWEEP_PER_LIMIT = 20

#: Queues whose key names a manager keeps built (a worker has a handful).
_QUEUE_KEYS_CACHED = 1024

_SCRIPTS = (
    "claim",
    "release",
    "extend",
    "renew",
    "peek",
    "list",
    "cleanup",
    "done",
    "ack_done",
    "read",
    "mark_started",
    "claim_many",
)

#: The most calls one ``claim_many`` script call carries (bounds the script's run time).
MANY_MAX_CALLS = 64

#: Driver errors that mean "the store could not be reached", as opposed to a bug.
_UNAVAILABLE: tuple[type[Exception], ...] = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.ClusterDownError,
    redis_errors.TryAgainError,
    redis_errors.ReadOnlyError,
    redis_errors.MasterDownError,
)


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Turn redis-py errors into the package's error tree at the backend boundary."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise BackendUnavailable(f"claim store unavailable: {exc}") from exc
    except redis_errors.RedisError as exc:
        raise BackendError(f"claim store error: {exc}") from exc


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@dataclass(frozen=True, slots=True)
class ScriptCall(Generic[_T]):
    """One script call, checked and built but not sent.

    :meth:`RedisClaimManager.execute` sends it through the manager's client; a worker's
    consumer sends it on its own connection (``celery_claims.worker.transport.pipe``). Either way
    the reply goes through ``decode``, which returns the result or raises the package's error.

    Attributes:
        script: the registered script (``sha`` for ``EVALSHA``, ``script`` for ``EVAL``).
        keys: the script's ``KEYS`` (shared by every call on the queue: never mutate it).
        args: the script's ``ARGV``.
        decode: maps the raw reply (bytes or str) to the result.
        many: how the call goes in one ``claim_many`` call with others of its queue
            (:func:`many_call`), or None for a call that goes alone.
    """

    script: Script
    keys: list[str]
    args: list[Any]
    decode: Callable[[Any], _T]
    many: ManyPart | None = None


@dataclass(frozen=True, slots=True)
class ManyPart:
    """A call's part in a ``claim_many`` script call (claim_many.lua).

    Attributes:
        script: the registered ``claim_many`` script (on the same client as the call's).
        keys: the ``KEYS`` of claim_many.lua for the call's queue (claim.lua's); calls with
            the same ``keys`` can go in one call.
        args: the operation code and the call's own ``ARGV``.
    """

    script: Script
    keys: list[str]
    args: list[Any]


def many_call(calls: Sequence[ScriptCall[Any]]) -> ScriptCall[list[Any]]:
    """One ``claim_many`` call that runs ``calls`` (all of one queue) in order.

    The result is the list of the calls' raw replies, in order: each is decoded with its own
    call's ``decode``, exactly as if the call had gone alone (an error reply of the script
    is every call's).

    Raises:
        InvalidArgument: no calls, more than :data:`MANY_MAX_CALLS`, a call that cannot go
            in a ``claim_many`` call, or calls of different queues.
    """
    parts = [call.many for call in calls]
    if not parts or len(parts) > MANY_MAX_CALLS:
        raise InvalidArgument("calls", f"must be 1..{MANY_MAX_CALLS} calls, got {len(parts)}")
    first = parts[0]
    if first is None or any(part is None or part.keys != first.keys for part in parts):
        raise InvalidArgument("calls", "must all be claims or records of one queue")
    args: list[Any] = []
    for part in parts:
        assert part is not None
        args += part.args
    return ScriptCall(first.script, first.keys, args, _many_replies)


def _many_replies(reply: Any) -> list[Any]:
    if not isinstance(reply, list):
        raise BackendError(f"claim_many.lua answered {reply!r:.200}, not a list")
    return reply


@dataclass(frozen=True, slots=True)
class StoredTask:
    """What the claim store holds for one task id, expired or not (:meth:`RedisClaimManager.read`).

    Attributes:
        task_id: the claim store's task id.
        claim: its claim entry as a token (``None``: no entry), live or expired.
        takeovers: the claim's takeovers so far (counted only with a takeover limit).
        record: its completion record (``None``: no record), within its retention or not.
        record_until_ms: epoch ms the record is kept until (0 without a record).
        start_unmarked: the claim was granted by a takeover under a takeover limit and its
            holder has not marked its start: its death would not count toward the limit.
    """

    task_id: str
    claim: ClaimToken | None
    takeovers: int
    record: AlreadyDone | GivenUp | None
    record_until_ms: int
    start_unmarked: bool = False


class RedisClaimManager:
    """Claim manager backed by Redis (standalone or Cluster).

    Args:
        url: a store URL in any form :func:`celery_claims.connect` takes
            (``redis://``, ``rediss://``, ``unix://``, ``sentinel://``, ``redis+cluster://``);
            the client gets the package's one timeout and retry policy.
        options: client options for ``url`` (``master_name``, ``ssl_*``, ``username``, ...;
            see :mod:`celery_claims.connection`).
        client: an existing ``redis.Redis`` or ``redis.RedisCluster`` (instead of ``url``).
        prefix: the first part of every key; must not contain ``{`` or ``}``.
        clock: returns epoch ms; ``None`` (the default) uses the Redis server's clock.
        wait_replicas: after each write (claim, release, complete, extend, renew), block until
            this many replicas acknowledged it (Redis ``WAIT``; one more round trip). 0, the
            default, does not wait. Standalone primaries only.
        wait_timeout_ms: the longest ``WAIT`` blocks; fewer acknowledgements then raise
            :class:`InsufficientReplicas`.

    Raises:
        InvalidArgument: neither or both of ``url`` and ``client``, a bad prefix, or
            ``wait_replicas`` with a Cluster client.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        options: Mapping[str, Any] | None = None,
        client: RedisClient | None = None,
        prefix: str = DEFAULT_PREFIX,
        clock: Clock | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1_000,
    ) -> None:
        if (url is None) == (client is None):
            raise InvalidArgument("url", "pass exactly one of url= and client=")
        if client is None and (not isinstance(url, str) or not url):
            raise InvalidArgument("url", f"must be a non-empty str, got {url!r:.80}")
        if options is not None and client is not None:
            raise InvalidArgument("options", "options go with url=, not with client=")
        if clock is not None and not callable(clock):
            raise InvalidArgument("clock", "must be a callable returning epoch ms, or None")
        require_ms("wait_timeout_ms", wait_timeout_ms)
        if isinstance(wait_replicas, bool) or not isinstance(wait_replicas, int):
            raise InvalidArgument("wait_replicas", "must be an int")
        if not 0 <= wait_replicas <= 64:
            raise InvalidArgument("wait_replicas", f"must be 0..64, got {wait_replicas}")
        if wait_replicas and isinstance(client, redis.RedisCluster):
            raise InvalidArgument("wait_replicas", "WAIT is supported on standalone Redis only")
        self.prefix = require_prefix(prefix)
        # every argument is checked before a client is built
        self._owns_client = client is None
        if client is None:
            assert url is not None
            spec = parse_store(url, options)
            if wait_replicas and spec.kind == "cluster":
                raise InvalidArgument("wait_replicas", "WAIT is supported on standalone Redis only")
            client = connect(url, options)
        self.client: RedisClient = client
        self._clock = clock
        self._wait = (wait_replicas, wait_timeout_ms)
        self._queues_key = queues_key(self.prefix)
        self._known_queues: set[str] = set()
        self._queue_keys: dict[str, QueueKeys] = {}
        self._scripts: dict[str, Script] = {
            name: client.register_script(script_source(name)) for name in _SCRIPTS
        }
        # how single calls are sent (send_calls_with), or None: through the client
        self._send: Callable[[ScriptCall[Any]], Any] | None = None

    def close(self) -> None:
        """Close the client if this manager created it from ``url=`` (a passed one is yours)."""
        if self._owns_client:
            close_client(self.client)

    def __enter__(self) -> RedisClaimManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def scripts(self) -> Mapping[str, Script]:
        """The registered scripts by operation name (``claim``, ``release``, ...)."""
        return MappingProxyType(self._scripts)

    @property
    def waits_for_replicas(self) -> bool:
        """True if each write waits for replicas (``wait_replicas`` > 0)."""
        return self._wait[0] > 0

    def _now(self) -> str:
        return "" if self._clock is None else str(int(self._clock()))

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        with translate_errors():
            return self._scripts[name](keys=keys, args=args)

    def _replicated(self, result: _T) -> _T:
        """Return ``result`` once enough replicas have the write (when asked to wait)."""
        required, timeout_ms = self._wait
        if required:
            with translate_errors():
                acknowledged = int(self.client.wait(required, timeout_ms))
            if acknowledged < required:
                raise InsufficientReplicas(result, acknowledged, required)
        return result

    def _register(self, queue_id: str) -> None:
        # The queue set lives in another Cluster slot, so it cannot be written inside the claim
        # script; it is added once per process, before the first claim (if this fails, nothing
        # has been claimed yet).
        if queue_id not in self._known_queues:
            with translate_errors():
                self.client.sadd(self._queues_key, queue_id)
            self._known_queues.add(queue_id)

    def keys(self, queue_id: str) -> QueueKeys:
        """The key names of ``queue_id`` (for operators and tests)."""
        keys = self._queue_keys.get(queue_id) if isinstance(queue_id, str) else None
        if keys is None:
            keys = QueueKeys(self.prefix, require_id("queue_id", queue_id))
            if len(self._queue_keys) >= _QUEUE_KEYS_CACHED:
                self._queue_keys.clear()
            self._queue_keys[queue_id] = keys
        return keys

    # --- the Rust AtomicClaimManager's API ---------------------------------------------------

    def claim(self, queue_id: str, task_id: str, owner: str, lease_ms: int) -> ClaimResult:
        """See :meth:`celery_claims.ClaimManager.claim`."""
        result = self.execute(self.claim_call(queue_id, task_id, owner, lease_ms, False))
        # without records or a takeover limit, claim.lua answers only the Rust
        # ``AtomicClaimManager``'s results
        assert isinstance(result, (Success, AlreadyClaimed, TookOver))
        return self._replicated(result) if result.acquired else result

    def claim_call(
        self,
        queue_id: str,
        task_id: str,
        owner: str,
        lease_ms: int,
        honour_done: bool = True,
        *,
        max_takeovers: int | None = None,
        given_up_ttl_ms: int = DEFAULT_GIVEN_UP_TTL_MS,
    ) -> ScriptCall[GateResult]:
        """The checked, unsent call of :meth:`claim_unless_done` (or of :meth:`claim`).

        Registers the queue first (one round trip, once per queue and process). With
        ``honour_done=False`` records are ignored, so a given-up task is only refused by the
        call that gives it up: pass ``max_takeovers`` with ``honour_done=True``.

        Raises:
            InvalidArgument: as :meth:`claim_unless_done`.
            BackendUnavailable: the queue could not be registered.
        """
        keys = self.keys(queue_id)
        require_id("task_id", task_id)
        require_id("owner", owner)
        require_ms("lease_ms", lease_ms)
        limit = require_max_takeovers(max_takeovers)
        require_ms("given_up_ttl_ms", given_up_ttl_ms)
        self._register(queue_id)
        args: list[Any] = [
            task_id,
            owner,
            lease_ms,
            self._now(),
            "1" if honour_done else "0",
            "" if limit is None else limit,
            given_up_ttl_ms,
        ]
        return ScriptCall(
            self._scripts["claim"],
            keys.claim_keys,
            args,
            partial(_gate_result, queue_id=queue_id, task_id=task_id, owner=owner),
            self._many("claim", keys, args),
        )

    def _many(self, name: str, keys: QueueKeys, args: list[Any]) -> ManyPart:
        """The part of a ``name`` call of queue ``keys`` in a ``claim_many`` call."""
        return ManyPart(self._scripts["claim_many"], keys.claim_keys, [MANY_OPS[name], *args])

    def execute(self, call: ScriptCall[_T]) -> _T:
        """Send ``call``, wait for its reply and decode it (one round trip).

        Raises:
            BackendUnavailable: the store could not be reached.
            BackendError: any other store error.
            ClaimTokenError: the call's own refusal (see its operation).
        """
        send = self._send
        with translate_errors():
            reply = call.script(keys=call.keys, args=call.args) if send is None else send(call)
        return call.decode(reply)

    def send_calls_with(self, send: Callable[[ScriptCall[Any]], Any] | None) -> None:
        """Send every single call (:meth:`execute`) with ``send(call)``, which returns the
        call's raw reply or raises redis-py's errors: a connection kept by the caller (a
        worker's pool process keeps one, ``celery_claims.worker.transport.sender.ScriptCaller``).
        None: through the client again.

        Raises:
            InvalidArgument: the manager waits for replicas (``WAIT`` counts the writes of
                the connection it is sent on, the client's, not the caller's).
        """
        if send is not None and self.waits_for_replicas:
            raise InvalidArgument(
                "send", "a manager that waits for replicas sends its calls through its client"
            )
        self._send = send

    def execute_many(self, calls: Sequence[ScriptCall[_T]]) -> list[_T]:
        """Send ``calls`` in one pipelined round trip (one by one on Redis Cluster, whose
        pipelines cannot load a script) and decode each reply, in order.

        Raises:
            as :meth:`execute`, for the first call whose reply is an error.
        """
        if isinstance(self.client, redis.RedisCluster):
            return [self.execute(call) for call in calls]
        with translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for call in calls:
                call.script(keys=call.keys, args=call.args, client=pipe)
            replies = pipe.execute()
        return [call.decode(reply) for call, reply in zip(calls, replies, strict=True)]

    def execute_each(self, calls: Sequence[ScriptCall[_T]]) -> list[_T | ClaimError]:
        """Send ``calls`` in one round trip (a pipeline, not a transaction), decode each reply.

        Unlike :meth:`execute_many`, a call whose reply is refused does not end the others.

        Returns:
            Each call's result, or the :class:`~celery_claims.errors.ClaimError` its reply
            was decoded to (a refused token, say), in the order of ``calls``.

        Raises:
            BackendUnavailable: the store could not be reached (none of the replies is known).
            BackendError: any other store error of the round trip.
        """
        if not calls:
            return []
        results: list[_T | ClaimError] = []
        if isinstance(self.client, redis.RedisCluster):
            # a Cluster pipeline cannot load a script: one call after the other
            for call in calls:
                try:
                    results.append(self.execute(call))
                except ClaimTokenError as exc:
                    results.append(exc)
            return results
        with translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for call in calls:
                call.script(keys=call.keys, args=call.args, client=pipe)
            replies = pipe.execute(raise_on_error=False)
        for call, reply in zip(calls, replies, strict=True):
            try:
                if isinstance(reply, BaseException):
                    with translate_errors():
                        raise reply
                results.append(call.decode(reply))
            except ClaimError as exc:
                results.append(exc)
        return results

    def release(self, token: ClaimToken) -> None:
        """See :meth:`celery_claims.ClaimManager.release`."""
        self._release(token, "")

    def _release(self, token: ClaimToken, done_ttl: str) -> None:
        self.execute(self._release_call(token, done_ttl))
        self._replicated(None)

    def _release_call(self, token: ClaimToken, done_ttl: str) -> ScriptCall[None]:
        require_token(token)
        keys = self.keys(token.queue_id)
        return ScriptCall(
            self._scripts["release"],
            keys.release_keys,
            [token.task_id, token.owner, token.instance, done_ttl, self._now()],
            partial(_token_result, token=token),
        )

    def extend(self, queue_id: str, token: ClaimToken, additional_ms: int) -> ClaimToken:
        """See :meth:`celery_claims.ClaimManager.extend`."""
        keys = self.keys(queue_id)
        require_token(token)
        require_ms("additional_ms", additional_ms)
        reply = self._run(
            "extend",
            keys.entry_keys,
            [token.task_id, token.owner, token.instance, additional_ms],
        )
        status = int(reply[0])
        if status != ClaimStatus.SUCCESS:
            raise token_error(status, token)
        return self._replicated(
            ClaimToken(
                queue_id,
                token.task_id,
                _text(reply[4]),
                int(reply[1]),
                int(reply[2]),
                int(reply[3]),
            )
        )

    def is_claimed(self, queue_id: str, task_id: str) -> tuple[str, int] | None:
        """See :meth:`celery_claims.ClaimManager.is_claimed`."""
        token = self._peek(queue_id, task_id)
        return None if token is None else (token.owner, token.expires_at)

    def get_token(self, queue_id: str, task_id: str, owner: str) -> ClaimToken | None:
        """See :meth:`celery_claims.ClaimManager.get_token`."""
        require_id("owner", owner)
        token = self._peek(queue_id, task_id)
        return token if token is not None and token.owner == owner else None

    def _peek(self, queue_id: str, task_id: str) -> ClaimToken | None:
        keys = self.keys(queue_id)
        require_id("task_id", task_id)
        reply = self._run("peek", keys.entry_keys, [task_id, self._now()])
        if not reply:
            return None
        instance, created, expires, owner = reply
        return ClaimToken(
            queue_id, task_id, _text(owner), int(instance), int(created), int(expires)
        )

    def known_queues(self) -> list[str]:
        """Every queue that has ever been claimed in, sorted."""
        with translate_errors():
            members = self.client.smembers(self._queues_key)
        return sorted(_text(m) for m in members)

    def cleanup_expired(self, *, limit: int | None = None) -> int:
        """See :meth:`celery_claims.ClaimManager.cleanup_expired`.

        There is no expiry index (it would store every task id a second time), so cleanup
        walks each queue's claims and records with ``HSCAN``, :data:`CLEANUP_BATCH` entries
        of each per script call. Without a limit it walks both hashes through from the start.
        With one, it resumes where the last run stopped and ends once ``limit`` claims are
        removed and, for each hash, once it is swept through or :data:`SWEEP_PER_LIMIT` times
        ``limit`` entries of it were examined; records past their retention are purged on the
        way and not counted.
        """
        budget = require_limit(limit)
        scan = None if budget is None else budget * SWEEP_PER_LIMIT
        removed = 0
        for queue_id in self.known_queues():
            left = None if budget is None else budget - removed
            removed += self._sweep(QueueKeys(self.prefix, queue_id), left, scan)
        return removed

    def _sweep(self, keys: QueueKeys, budget: int | None, scan: int | None) -> int:
        """Sweep one queue (see :meth:`cleanup_expired`); returns the claims removed."""
        claims, records = _Walk.first(budget, scan), _Walk.first(budget, scan)
        if budget is not None and budget <= 0:
            claims.cursor = _Walk.DONE  # nothing more may be removed; records are still purged
        removed = 0
        while not (claims.done and records.done):
            most = CLEANUP_BATCH if budget is None else budget - removed
            reply = self._run(
                "cleanup",
                keys.cleanup_keys,
                [self._now(), most, CLEANUP_BATCH, claims.cursor, records.cursor],
            )
            gone, _, claims_next, records_next, claims_read, records_read = reply
            removed += int(gone)
            # a call that removed its most may have left expired claims on its page
            claims.advance(_text(claims_next), int(claims_read), swept=int(gone) < most)
            records.advance(_text(records_next), int(records_read), swept=True)
            if budget is not None and removed >= budget:
                claims.cursor = _Walk.DONE
        return removed

    def stats(self) -> ClaimStats:
        """See :meth:`celery_claims.ClaimManager.stats`."""
        total = ClaimStats()
        for per_queue in self.queue_stats().values():
            total += per_queue
        return total

    def queue_stats(self) -> dict[str, ClaimStats]:
        """The counters of each known queue (two round trips in all)."""
        queues = self.known_queues()
        with translate_errors():
            pipe = self.client.pipeline(transaction=False)
            for queue_id in queues:
                pipe.hgetall(QueueKeys(self.prefix, queue_id).stats)
            replies = pipe.execute()
        return {
            queue_id: ClaimStats(**{_text(k): int(v) for k, v in reply.items()})
            for queue_id, reply in zip(queues, replies, strict=True)
        }

    def active_claims(self, queue_id: str) -> int:
        """See :meth:`celery_claims.ClaimManager.active_claims`."""
        keys = self.keys(queue_id)
        return int(self._run("list", keys.entry_keys, [self._now(), "count"]))

    def list_claims(self, queue_id: str) -> list[ClaimToken]:
        """See :meth:`celery_claims.ClaimManager.list_claims`."""
        keys = self.keys(queue_id)
        reply = self._run("list", keys.entry_keys, [self._now(), "list"])
        tokens = [
            ClaimToken(queue_id, _text(task), _text(owner), int(instance), int(created), int(ends))
            for task, instance, created, ends, owner in zip(*[iter(reply)] * 5, strict=True)
        ]
        # soonest expiry first, ties by task id (the order of the Rust ``AtomicClaimManager``'s
        # sorted index)
        return sorted(tokens, key=lambda t: (t.expires_at, t.task_id))

    # --- additions for the Celery integration ---------------------------------------------

    def claim_unless_done(
        self,
        queue_id: str,
        task_id: str,
        owner: str,
        lease_ms: int,
        *,
        max_takeovers: int | None = None,
        given_up_ttl_ms: int = DEFAULT_GIVEN_UP_TTL_MS,
    ) -> GateResult:
        """See :meth:`celery_claims.ClaimManager.claim_unless_done`."""
        call = self.claim_call(
            queue_id,
            task_id,
            owner,
            lease_ms,
            True,
            max_takeovers=max_takeovers,
            given_up_ttl_ms=given_up_ttl_ms,
        )
        result = self.execute(call)
        # AlreadyClaimed and AlreadyDone wrote only counters: nothing worth waiting for
        if result.acquired or isinstance(result, GivenUp):
            return self._replicated(result)
        return result

    def mark_started(self, token: ClaimToken) -> None:
        """See :meth:`celery_claims.ClaimManager.mark_started`."""
        self.execute(self.mark_started_call(token))

    def mark_started_call(self, token: ClaimToken) -> ScriptCall[None]:
        """The checked, unsent call of :meth:`mark_started`.

        Raises:
            InvalidArgument: a malformed token.
        """
        require_token(token)
        return ScriptCall(
            self._scripts["mark_started"],
            self.keys(token.queue_id).entry_keys,
            [token.task_id, token.owner, token.instance],
            partial(_token_result, token=token),
        )

    def complete(self, token: ClaimToken, done_ttl_ms: int) -> None:
        """See :meth:`celery_claims.ClaimManager.complete`."""
        self.execute(self.complete_call(token, done_ttl_ms))
        self._replicated(None)

    def complete_call(self, token: ClaimToken, done_ttl_ms: int) -> ScriptCall[None]:
        """The checked, unsent call of :meth:`complete`.

        Raises:
            InvalidArgument: as :meth:`complete`.
        """
        require_ms("done_ttl_ms", done_ttl_ms)
        return self._release_call(token, str(done_ttl_ms))

    def ack_done_call(
        self, token: ClaimToken, done_ttl_ms: int, ack_keys: tuple[str, str], delivery_tag: str
    ) -> ScriptCall[bool]:
        """:meth:`complete`, and the removal of a Redis broker delivery, in one script.

        For a claim store that is the broker's own Redis (same server and database): the
        delivery (kombu's ``unacked_index`` and ``unacked`` keys, ``ack_keys``) is removed
        only when the completion is recorded for ``token``, now or earlier (the call's result
        is then ``True`` if it recorded it, ``False`` if it found it recorded). A refused
        token leaves the delivery alone: on the Redis broker another copy's delivery may be
        that very record.

        Raises:
            InvalidArgument: a bad token, TTL, key or tag.
            ClaimTokenError: (when executed) the token was refused; nothing was written.
        """
        require_token(token)
        require_ms("done_ttl_ms", done_ttl_ms)
        require_id("ack_keys", ack_keys[0])
        require_id("ack_keys", ack_keys[1])
        require_id("delivery_tag", delivery_tag)
        keys = self.keys(token.queue_id)
        return ScriptCall(
            self._scripts["ack_done"],
            [*keys.release_keys, *ack_keys],
            [token.task_id, token.owner, token.instance, done_ttl_ms, self._now(), delivery_tag],
            partial(_ack_done_result, token=token),
        )

    def record_call(self, token: ClaimToken, done_ttl_ms: int) -> ScriptCall[bool]:
        """:meth:`complete`, where a record ``token`` wrote before counts as written.

        For a record that may have been sent ahead by another process of the same owner (a
        worker's pool process): the call's result is ``True`` if it recorded the completion,
        ``False`` if it found it recorded by ``token``. One round trip either way.

        Raises:
            InvalidArgument: a bad token or TTL.
            ClaimTokenError: (when executed) the token was refused; nothing was written.
        """
        require_token(token)
        require_ms("done_ttl_ms", done_ttl_ms)
        keys = self.keys(token.queue_id)
        args: list[Any] = [token.task_id, token.owner, token.instance, done_ttl_ms, self._now(), ""]
        return ScriptCall(
            self._scripts["ack_done"],
            keys.release_keys,
            args,
            partial(_ack_done_result, token=token),
            self._many("ack_done", keys, args),
        )

    def done_record(self, queue_id: str, task_id: str) -> AlreadyDone | GivenUp | None:
        """See :meth:`celery_claims.ClaimManager.done_record`."""
        return self.execute(self.done_record_call(queue_id, task_id))

    def done_record_call(
        self, queue_id: str, task_id: str
    ) -> ScriptCall[AlreadyDone | GivenUp | None]:
        """The checked, unsent call of :meth:`done_record`.

        Raises:
            InvalidArgument: a bad queue or task id.
        """
        keys = self.keys(queue_id)
        require_id("task_id", task_id)
        return ScriptCall(
            self._scripts["done"],
            keys.record_keys,
            [task_id, self._now()],
            partial(_done_result, queue_id=queue_id, task_id=task_id),
        )

    def read(self, queue_id: str, task_ids: Sequence[str]) -> list[StoredTask]:
        """What the store holds for each of ``task_ids``, expired or not (one round trip).

        For operators' views (``celery claims inspect``) and tests: the gate never needs it.

        Raises:
            InvalidArgument: a bad queue or task id.
            BackendUnavailable: the store could not be reached.
        """
        return self.execute(self.read_call(queue_id, task_ids))

    def read_call(self, queue_id: str, task_ids: Sequence[str]) -> ScriptCall[list[StoredTask]]:
        """The checked, unsent call of :meth:`read` (to pipeline several queues)."""
        keys = self.keys(queue_id)
        names = [require_id("task_ids", task_id) for task_id in task_ids]
        return ScriptCall(
            self._scripts["read"],
            keys.read_keys,
            names,
            partial(_stored_tasks, queue_id=queue_id, task_ids=names),
        )

    def renew(
        self, queue_id: str, tokens: Sequence[ClaimToken], lease_ms: int
    ) -> list[ClaimToken | ClaimTokenError]:
        """See :meth:`celery_claims.ClaimManager.renew`."""
        keys = self.keys(queue_id)
        checked = require_tokens(tokens)
        require_ms("lease_ms", lease_ms)
        if not checked:
            return []
        args: list[Any] = [lease_ms, self._now()]
        for token in checked:
            args += [token.task_id, token.owner, token.instance]
        reply = self._run("renew", keys.entry_keys, args)
        results: list[ClaimToken | ClaimTokenError] = []
        for token, status, created_at, expires_at in zip(
            checked, reply[::3], reply[1::3], reply[2::3], strict=True
        ):
            if int(status) == ClaimStatus.SUCCESS:
                renewed = ClaimToken(
                    queue_id,
                    token.task_id,
                    token.owner,
                    token.instance,
                    int(created_at),
                    int(expires_at),
                )
                results.append(renewed)
            else:
                results.append(token_error(int(status), token))
        return self._replicated(results)


@dataclass(slots=True)
class _Walk:
    """Cleanup's walk over one hash: the ``HSCAN`` cursor to send, and what is left to read."""

    #: The cursor sent for a hash that is done with (cleanup.lua reads nothing of it).
    DONE = "-"

    cursor: str
    left: int | None  # entries still to examine this run (None: no bound)

    @classmethod
    def first(cls, budget: int | None, scan: int | None) -> _Walk:
        # without a limit a run walks from the start; with one it resumes the saved cursor ('')
        return cls("0" if budget is None else "", scan)

    @property
    def done(self) -> bool:
        return self.cursor == self.DONE

    def advance(self, cursor: str, examined: int, *, swept: bool) -> None:
        if self.done:
            return
        if self.left is not None:
            self.left -= examined
        through = cursor == "0" and swept
        self.cursor = self.DONE if through or (self.left is not None and self.left <= 0) else cursor


def _stored_tasks(reply: Any, queue_id: str, task_ids: list[str]) -> list[StoredTask]:
    stored = []
    for index, task_id in enumerate(task_ids):
        instance, created, expires, takeovers, owner, unstarted, kind, number, at, until, by = (
            reply[11 * index : 11 * index + 11]
        )
        claim = None
        if int(instance):
            claim = ClaimToken(
                queue_id, task_id, _text(owner), int(instance), int(created), int(expires)
            )
        record = None
        if int(kind):
            found = _gate_result([kind, number, at, by], queue_id, task_id, "")
            if not isinstance(found, (AlreadyDone, GivenUp)):
                raise BackendError(f"read.lua answered {found!r}, not a record")
            record = found
        stored.append(
            StoredTask(task_id, claim, int(takeovers), record, int(until), int(unstarted) == 1)
        )
    return stored


def _token_result(reply: Any, token: ClaimToken) -> None:
    """The reply ``{status}`` of a script that only checks and writes ``token``'s entry."""
    status = int(reply[0])
    if status != ClaimStatus.SUCCESS:
        raise token_error(status, token)


def _ack_done_result(reply: Any, token: ClaimToken) -> bool:
    status = int(reply[0])
    if status not in (ClaimStatus.SUCCESS, ClaimStatus.DONE):
        raise token_error(status, token)
    return status == ClaimStatus.SUCCESS


def _done_result(reply: Any, queue_id: str, task_id: str) -> AlreadyDone | GivenUp | None:
    if not reply:
        return None
    record = _gate_result(reply, queue_id=queue_id, task_id=task_id, owner="")
    if not isinstance(record, (AlreadyDone, GivenUp)):
        raise BackendError(f"done.lua answered {record!r}, not a record")
    return record


def _gate_result(reply: Any, queue_id: str, task_id: str, owner: str) -> GateResult:
    """Map a claim.lua (or done.lua) reply to its result: the one place that reads claim codes."""
    status = int(reply[0])
    if status in (ClaimStatus.SUCCESS, ClaimStatus.TOOK_OVER):
        _, instance, created, expires, previous = reply
        token = ClaimToken(queue_id, task_id, owner, int(instance), int(created), int(expires))
        if status == ClaimStatus.SUCCESS:
            return Success(token=token)
        return TookOver(previous_owner=_text(previous), token=token)
    if status == ClaimStatus.ALREADY_CLAIMED:
        return AlreadyClaimed(owner=_text(reply[1]), expires_at=int(reply[2]))
    if status == ClaimStatus.DONE:
        return AlreadyDone(owner=_text(reply[3]), instance=int(reply[1]), done_at=int(reply[2]))
    if status == ClaimStatus.GIVEN_UP:
        return GivenUp(
            previous_owner=_text(reply[3]), takeovers=int(reply[1]), given_up_at=int(reply[2])
        )
    raise BackendError(f"unknown claim status code {status!r} from the claim store")
