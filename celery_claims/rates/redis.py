"""``RedisRateLimiter``: fleet-wide rates in the claim store, one Lua script per start.

Each limit is one string key under its scope's hash tag, ``<prefix>:{<scope>}:r:<name>``. A
key holds when its limit's next start is due and expires once that ms has passed: an idle
limit costs nothing, and limits can be as many as there are keys (one per customer). Time is
the Redis server's (``TIME`` in the script), one clock for the whole fleet; ``clock=`` sends
the caller's (tests). :meth:`RedisRateLimiter.claim_part` puts a start's check in its claim's
own call (``claim_rated.lua``, ``lua/_common.lua``'s ``rate_check`` and ``rate_commit``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from redis.commands.core import Script

from celery_claims.claims.calls import (
    CALLER_CLOCK_TTL_PAD_MS,
    RatePart,
    RedisClient,
    ScriptCall,
    translate_errors,
)
from celery_claims.claims.keys import DEFAULT_PREFIX, QueueKeys, require_prefix
from celery_claims.claims.scripts import script_source
from celery_claims.clock import Clock
from celery_claims.connection import close as close_client
from celery_claims.connection import connect
from celery_claims.errors import BackendError, InvalidArgument
from celery_claims.rates.model import (
    Limit,
    RateAllowed,
    RateLimited,
    RateResult,
    RateStatus,
    require_limits,
)
from celery_claims.validation import require_id

__all__ = ["CALLER_CLOCK_TTL_PAD_MS", "RedisRateLimiter"]

_T = TypeVar("_T")

#: Scopes whose key names a limiter keeps built (a worker has a handful of queues).
_SCOPES_CACHED = 1024


class RedisRateLimiter:
    """Rate limiter backed by Redis (standalone or Cluster), usually the claim store's.

    Args:
        url: a store URL in any form :func:`celery_claims.connect` takes.
        options: client options for ``url`` (see :mod:`celery_claims.connection`).
        client: an existing ``redis.Redis`` or ``redis.RedisCluster`` (instead of ``url``).
        prefix: the first part of every key (the claim manager's, to share its hash tags);
            must not contain ``{`` or ``}``.
        clock: returns epoch ms; ``None`` (the default) uses the Redis server's clock.

    Raises:
        InvalidArgument: neither or both of ``url`` and ``client``, or a bad prefix or clock.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        options: Mapping[str, Any] | None = None,
        client: RedisClient | None = None,
        prefix: str = DEFAULT_PREFIX,
        clock: Clock | None = None,
    ) -> None:
        if (url is None) == (client is None):
            raise InvalidArgument("url", "pass exactly one of url= and client=")
        if client is None and (not isinstance(url, str) or not url):
            raise InvalidArgument("url", f"must be a non-empty str, got {url!r:.80}")
        if options is not None and client is not None:
            raise InvalidArgument("options", "options go with url=, not with client=")
        if clock is not None and not callable(clock):
            raise InvalidArgument("clock", "must be a callable returning epoch ms, or None")
        self.prefix = require_prefix(prefix)
        # every argument is checked before a client is built
        self._owns_client = client is None
        if client is None:
            assert url is not None
            client = connect(url, options)
        self.client: RedisClient = client
        self._clock = clock
        self._pad = "0" if clock is None else str(CALLER_CLOCK_TTL_PAD_MS)
        self._scopes: dict[str, QueueKeys] = {}
        self.script: Script = client.register_script(script_source("rate"))

    def close(self) -> None:
        """Close the client if this limiter created it from ``url=`` (a passed one is yours)."""
        if self._owns_client:
            close_client(self.client)

    def __enter__(self) -> RedisRateLimiter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def keys(self, scope: str, limits: Sequence[Limit]) -> list[str]:
        """The key of each limit of ``limits`` in ``scope`` (for operators and tests).

        Raises:
            InvalidArgument: as :meth:`acquire`.
        """
        tagged = self._scopes.get(scope) if isinstance(scope, str) else None
        if tagged is None:
            tagged = QueueKeys(self.prefix, require_id("scope", scope))
            if len(self._scopes) >= _SCOPES_CACHED:
                self._scopes.clear()
            self._scopes[scope] = tagged
        return [tagged.rate(limit.name) for limit in require_limits(limits)]

    def acquire(self, scope: str, limits: Sequence[Limit]) -> RateResult:
        """See :meth:`celery_claims.rates.RateLimiter.acquire`."""
        return self.execute(self.acquire_call(scope, limits))

    def acquire_call(self, scope: str, limits: Sequence[Limit]) -> ScriptCall[RateResult]:
        """The checked, unsent call of :meth:`acquire` (a worker sends it on its own
        connection, as it sends a claim).

        Raises:
            InvalidArgument: as :meth:`acquire`.
        """
        keys = self.keys(scope, limits)
        args: list[Any] = ["" if self._clock is None else str(int(self._clock())), self._pad]
        names = []
        for limit in limits:
            args += [limit.rate.count, limit.rate.period_ms]
            names.append(limit.name)
        return ScriptCall(self.script, keys, args, partial(rate_result, names=names))

    def claim_part(self, scope: str, limits: Sequence[Limit]) -> RatePart:
        """The check of :meth:`acquire`, to go in a claim's own call
        (``RedisClaimManager.claim_call(..., rate=...)``, ``claim_rated.lua``): counted once
        the claim is granted, by the claim store's clock, and read as a :data:`RateResult`.

        Raises:
            InvalidArgument: as :meth:`acquire`.
        """
        keys = self.keys(scope, limits)
        args: list[Any] = []
        names = []
        for limit in limits:
            args += [limit.rate.count, limit.rate.period_ms]
            names.append(limit.name)
        return RatePart(keys, args, partial(rate_result, names=names))

    def execute(self, call: ScriptCall[_T]) -> _T:
        """Send ``call``, wait for its reply and decode it (one round trip).

        Raises:
            BackendUnavailable: the store could not be reached.
            BackendError: any other store error.
        """
        with translate_errors():
            reply = call.script(keys=call.keys, args=call.args)
        return call.decode(reply)


def rate_result(reply: Any, names: Sequence[str]) -> RateResult:
    """Map a ``rate.lua`` reply to its result: the one place that reads rate codes."""
    status = int(reply[0])
    if status == RateStatus.ALLOWED:
        return RateAllowed(int(reply[1]), tuple(int(ms) for ms in reply[2:]))
    if status == RateStatus.LIMITED:
        return RateLimited(int(reply[1]), int(reply[2]), names[int(reply[3]) - 1])
    raise BackendError(f"unknown rate status code {status!r} from the claim store")
