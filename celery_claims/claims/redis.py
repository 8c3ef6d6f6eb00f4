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
from functools import cache, partial
from importlib import resources
from types import MappingProxyType
from typing import Any, Generic, TypeAlias, TypeVar

import redis
import redis.exceptions as redis_errors
from redis.commands.core import Script

from celery_claims.claims.keys import DEFAULT_PREFIX, QueueKeys, queues_key, require_prefix
from celery_claims.claims.status import token_error
from celery_claims.clock import Clock
from celery_claims.connection import close as close_client
from celery_claims.connection import connect
from celery_claims.connection import parse as parse_store
from celery_claims.errors import (
    BackendError,
    BackendUnavailable,
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

__all__ = ["RedisClaimManager", "RedisClient", "ScriptCall"]

_T = TypeVar("_T")

#: A standalone or cluster redis-py client.
RedisClient: TypeAlias = "redis.Redis | redis.RedisCluster"

#: Expired claims removed per script call by ``cleanup_expired``; bounds each call's run time.
CLEANUP_BATCH = 500

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
)

#: Driver errors that mean "the store could not be reached", as opposed to a bug.
_UNAVAILABLE: tuple[type[Exception], ...] = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.ClusterDownError,
    redis_errors.TryAgainError,
    redis_errors.ReadOnlyError,
    redis_errors.MasterDownError,
)


@cache
def _source(name: str) -> str:
    lua = resources.files("celery_claims.claims") / "lua"
    return (
        (lua / "_common.lua").read_text("utf-8") + "\n" + (lua / f"{name}.lua").read_text("utf-8")
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
    consumer sends it on its own connection (``celery_claims.worker.pipe``). Either way the
    reply goes through ``decode``, which returns the result or raises the package's error.

    Attributes:
        script: the registered script (``sha`` for ``EVALSHA``, ``script`` for ``EVAL``).
        keys: the script's ``KEYS`` (shared by every call on the queue: never mutate it).
        args: the script's ``ARGV``.
        decode: maps the raw reply (bytes or str) to the result.
    """

    script: Script
    keys: list[str]
    args: list[Any]
    decode: Callable[[Any], _T]


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
            name: client.register_script(_source(name)) for name in _SCRIPTS
        }

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

    # --- the original API -----------------------------------------------------------------

    def claim(self, queue_id: str, task_id: str, owner: str, lease_ms: int) -> ClaimResult:
        """See :meth:`celery_claims.ClaimManager.claim`."""
        result = self.execute(self.claim_call(queue_id, task_id, owner, lease_ms, False))
        # without records or a takeover limit, claim.lua answers only the original's results
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
        return ScriptCall(
            self._scripts["claim"],
            keys.claim_keys,
            [
                task_id,
                owner,
                lease_ms,
                self._now(),
                "1" if honour_done else "0",
                "" if limit is None else limit,
                given_up_ttl_ms,
            ],
            partial(_gate_result, queue_id=queue_id, task_id=task_id, owner=owner),
        )

    def execute(self, call: ScriptCall[_T]) -> _T:
        """Send ``call``, wait for its reply and decode it (one round trip).

        Raises:
            BackendUnavailable: the store could not be reached.
            BackendError: any other store error.
            ClaimTokenError: the call's own refusal (see its operation).
        """
        with translate_errors():
            reply = call.script(keys=call.keys, args=call.args)
        return call.decode(reply)

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
            partial(_release_result, token=token),
        )

    def extend(self, queue_id: str, token: ClaimToken, additional_ms: int) -> ClaimToken:
        """See :meth:`celery_claims.ClaimManager.extend`."""
        keys = self.keys(queue_id)
        require_token(token)
        require_ms("additional_ms", additional_ms)
        reply = self._run(
            "extend",
            [keys.claims, keys.expiries],
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
        reply = self._run("peek", [keys.claims], [task_id, self._now()])
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
        """See :meth:`celery_claims.ClaimManager.cleanup_expired`."""
        budget = require_limit(limit)
        removed = 0
        for queue_id in self.known_queues():
            keys = QueueKeys(self.prefix, queue_id)
            while budget is None or removed < budget:
                batch = CLEANUP_BATCH if budget is None else min(CLEANUP_BATCH, budget - removed)
                claims, records = self._run("cleanup", keys.cleanup_keys, [self._now(), batch])
                removed += int(claims)
                # a full batch of either kind means more may be waiting
                if int(claims) < batch and int(records) < batch:
                    break
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
        return int(self._run("list", [keys.claims, keys.expiries], [self._now(), "count"]))

    def list_claims(self, queue_id: str) -> list[ClaimToken]:
        """See :meth:`celery_claims.ClaimManager.list_claims`."""
        keys = self.keys(queue_id)
        reply = self._run("list", [keys.claims, keys.expiries], [self._now(), "list"])
        tokens = []
        for task, entry in zip(reply[::2], reply[1::2], strict=True):
            instance, created, expires, owner = _text(entry).split(":", 3)
            tokens.append(
                ClaimToken(queue_id, _text(task), owner, int(instance), int(created), int(expires))
            )
        return tokens

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

    def done_record(self, queue_id: str, task_id: str) -> AlreadyDone | GivenUp | None:
        """See :meth:`celery_claims.ClaimManager.done_record`."""
        keys = self.keys(queue_id)
        require_id("task_id", task_id)
        reply = self._run("done", [keys.done], [task_id, self._now()])
        if not reply:
            return None
        record = _gate_result(reply, queue_id=queue_id, task_id=task_id, owner="")
        if not isinstance(record, (AlreadyDone, GivenUp)):
            raise BackendError(f"done.lua answered {record!r}, not a record")
        return record

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
        reply = self._run("renew", [keys.claims, keys.expiries], args)
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


def _release_result(reply: Any, token: ClaimToken) -> None:
    status = int(reply[0])
    if status != ClaimStatus.SUCCESS:
        raise token_error(status, token)


def _ack_done_result(reply: Any, token: ClaimToken) -> bool:
    status = int(reply[0])
    if status not in (ClaimStatus.SUCCESS, ClaimStatus.DONE):
        raise token_error(status, token)
    return status == ClaimStatus.SUCCESS


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
