"""``RedisClaimManager``: the claim store of record, one Lua script and one round trip per call.

Expiry is judged by the Redis server's clock (``TIME`` inside each script), so every worker
agrees on it whatever its own clock says; a ``clock=`` callable sends the caller's time instead
(tests under freezegun). Works with standalone Redis and Redis Cluster clients, with
``decode_responses`` on or off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis
from redis.commands.core import Script

from celery_claims.claims.calls import (
    SCRIPTS,
    ManyPart,
    RatedClaim,
    RedisClient,
    ScriptCall,
    ScriptRunner,
    as_text,
    gate_result,
    translate_errors,
)
from celery_claims.claims.keys import DEFAULT_PREFIX, QueueKeys, queues_key, require_prefix
from celery_claims.claims.scripts import script_source
from celery_claims.claims.status import token_error
from celery_claims.clock import Clock
from celery_claims.connection import close as close_client
from celery_claims.connection import connect
from celery_claims.connection import parse as parse_store
from celery_claims.errors import (
    BackendError,
    ClaimTokenError,
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
    require_ms,
    require_token,
    require_tokens,
)

__all__ = ["RedisClaimManager", "StoredTask"]


#: Entries of each hash one ``cleanup_expired`` script call examines; bounds its run time.
CLEANUP_BATCH = 500

#: A ``cleanup_expired`` run with a limit examines at most this many entries of each hash of a
#: queue per claim it may remove (with the defaults, 200,000 per run of each hash).
SWEEP_PER_LIMIT = 20


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


class RedisClaimManager(ScriptRunner):
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
        self._many_parts: dict[tuple[str, str], ManyPart] = {}
        self._scripts: dict[str, Script] = {
            name: client.register_script(script_source(name)) for name in SCRIPTS
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

    # --- the Rust AtomicClaimManager's API ---------------------------------------------------

    def claim(self, queue_id: str, task_id: str, owner: str, lease_ms: int) -> ClaimResult:
        """See :meth:`celery_claims.ClaimManager.claim`."""
        result = self.execute(self.claim_call(queue_id, task_id, owner, lease_ms, False))
        # without records or a takeover limit, claim.lua answers only the Rust
        # ``AtomicClaimManager``'s results
        assert isinstance(result, (Success, AlreadyClaimed, TookOver))
        return self._replicated(result) if result.acquired else result

    def release(self, token: ClaimToken) -> None:
        """See :meth:`celery_claims.ClaimManager.release`."""
        self._release(token, "")

    def _release(self, token: ClaimToken, done_ttl: str) -> None:
        self.execute(self._release_call(token, done_ttl))
        self._replicated(None)

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
                as_text(reply[4]),
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
            queue_id, task_id, as_text(owner), int(instance), int(created), int(expires)
        )

    def known_queues(self) -> list[str]:
        """Every queue that has ever been claimed in, sorted."""
        with translate_errors():
            members = self.client.smembers(self._queues_key)
        return sorted(as_text(m) for m in members)

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
            claims.advance(as_text(claims_next), int(claims_read), swept=int(gone) < most)
            records.advance(as_text(records_next), int(records_read), swept=True)
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
            queue_id: ClaimStats(**{as_text(k): int(v) for k, v in reply.items()})
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
            ClaimToken(
                queue_id, as_text(task), as_text(owner), int(instance), int(created), int(ends)
            )
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
        run: int | None = None,
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
            run=run,
        )
        result = self.execute(call)
        assert not isinstance(result, RatedClaim)  # no rates were asked
        # AlreadyClaimed and AlreadyDone wrote only counters: nothing worth waiting for
        if result.acquired or isinstance(result, GivenUp):
            return self._replicated(result)
        return result

    def mark_started(self, token: ClaimToken) -> None:
        """See :meth:`celery_claims.ClaimManager.mark_started`."""
        self.execute(self.mark_started_call(token))

    def complete(self, token: ClaimToken, done_ttl_ms: int) -> None:
        """See :meth:`celery_claims.ClaimManager.complete`."""
        self.execute(self.complete_call(token, done_ttl_ms))
        self._replicated(None)

    def done_record(self, queue_id: str, task_id: str) -> AlreadyDone | GivenUp | None:
        """See :meth:`celery_claims.ClaimManager.done_record`."""
        return self.execute(self.done_record_call(queue_id, task_id))

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
                queue_id, task_id, as_text(owner), int(instance), int(created), int(expires)
            )
        record = None
        if int(kind):
            found = gate_result([kind, number, at, by], queue_id, task_id, "")
            if not isinstance(found, (AlreadyDone, GivenUp)):
                raise BackendError(f"read.lua answered {found!r}, not a record")
            record = found
        stored.append(
            StoredTask(task_id, claim, int(takeovers), record, int(until), int(unstarted) == 1)
        )
    return stored
