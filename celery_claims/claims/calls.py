"""Script calls on the claim store: how one operation becomes one Lua call, and how calls run.

:class:`ScriptCall` is one operation ready to send (a script, its keys and arguments, and how
its reply reads); :class:`ScriptRunner` builds them for a claim manager and runs them, one at a
time, many in one ``claim_many.lua`` call, or each on its own where a Cluster spreads them.
:class:`~celery_claims.claims.redis.RedisClaimManager` is a ``ScriptRunner`` with the claim
API on top; the worker sends the calls on connections of its own.
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

from celery_claims.claims.keys import QueueKeys
from celery_claims.claims.scripts import MANY_OPS
from celery_claims.claims.status import token_error
from celery_claims.clock import Clock
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
    ClaimStatus,
    ClaimToken,
    GateResult,
    GivenUp,
    Success,
    TookOver,
)
from celery_claims.runs import format_run
from celery_claims.validation import (
    require_id,
    require_max_takeovers,
    require_ms,
    require_token,
)

__all__ = [
    "CALLER_CLOCK_TTL_PAD_MS",
    "MANY_MAX_CALLS",
    "ManyPart",
    "RatePart",
    "RatedClaim",
    "RedisClient",
    "ScriptCall",
    "SCRIPTS",
    "ScriptRunner",
    "as_text",
    "gate_result",
    "many_call",
    "translate_errors",
    "translated",
]

_T = TypeVar("_T")


#: A standalone or cluster redis-py client.
RedisClient: TypeAlias = "redis.Redis | redis.RedisCluster"


#: Queues whose key names a manager keeps built (a worker has a handful).
_QUEUE_KEYS_CACHED = 1024


SCRIPTS = (
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
    "claim_rated",
)


#: Ms added to each rate key's TTL when the caller sends its own clock (``clock=``). A TTL runs
#: on the server's real time, which a caller's clock need not follow (a test's manual clock
#: stands still): a key kept too long changes no answer, one gone too soon lets a start early.
CALLER_CLOCK_TTL_PAD_MS = 3_600_000

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
    except redis_errors.RedisError as exc:
        raise translated(exc) from exc


def translated(exc: redis_errors.RedisError) -> BackendError:
    """The package's error for redis-py's ``exc`` (raise it ``from exc``):
    :class:`BackendUnavailable` where the store could not be reached, else
    :class:`BackendError`."""
    if isinstance(exc, _UNAVAILABLE):
        return BackendUnavailable(f"claim store unavailable: {exc}")
    return BackendError(f"claim store error: {exc}")


def as_text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@dataclass(slots=True)
class ScriptCall(Generic[_T]):
    """One script call, checked and built but not sent; never changed once built.

    :meth:`RedisClaimManager.execute` sends it through the manager's client; a worker's
    consumer sends it on its own connection (``celery_claims.worker.transport.pipe``). Either way
    the reply goes through ``decode``, which returns the result or raises the package's error.
    Not a frozen dataclass: a worker builds two a message, and a frozen one costs three times
    as much to build (each field set through ``object.__setattr__``).

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
    """How a call goes in a ``claim_many`` script call (claim_many.lua): its operation code
    and then its own ``ARGV``. One per operation and queue, shared by their calls.

    Attributes:
        script: the registered ``claim_many`` script (on the same client as the call's).
        keys: the ``KEYS`` of claim_many.lua for the call's queue (claim.lua's); calls with
            the same ``keys`` can go in one call.
        op: the operation's code in claim_many.lua (``MANY_OPS``).
    """

    script: Script
    keys: list[str]
    op: str


@dataclass(frozen=True, slots=True)
class RatePart:
    """A start's rates, to be checked in its claim's own call (``claim_rated.lua``).

    Built by :meth:`celery_claims.rates.RedisRateLimiter.claim_part`; the claim store knows
    nothing of rates but where their keys and arguments go and who reads their verdict.

    Attributes:
        keys: the rate key of each limit (``rate.lua``'s ``KEYS``).
        args: each limit's count and period in ms, in the keys' order.
        decode: reads the verdict (``rate.lua``'s reply) into the limiter's result.
    """

    keys: list[str]
    args: list[Any]
    decode: Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class RatedClaim:
    """A granted claim and its start's verdict, answered by one ``claim_rated.lua`` call.

    A claim that is not granted (held, done, given up) is answered alone: it counted no start.

    Attributes:
        claim: the granted claim (``Success`` or ``TookOver``): the copy holds it whatever
            the verdict says.
        rate: the verdict (a :class:`celery_claims.rates.RateResult`): the start was counted
            (``RateAllowed``), or it must wait (``RateLimited``).
    """

    claim: Success | TookOver
    rate: Any


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
    for call in calls:
        assert call.many is not None
        args.append(call.many.op)
        args += call.args
    return ScriptCall(first.script, first.keys, args, _many_replies)


def _many_replies(reply: Any) -> list[Any]:
    if not isinstance(reply, list):
        raise BackendError(f"claim_many.lua answered {reply!r:.200}, not a list")
    return reply


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
    record = gate_result(reply, queue_id=queue_id, task_id=task_id, owner="")
    if not isinstance(record, (AlreadyDone, GivenUp)):
        raise BackendError(f"done.lua answered {record!r}, not a record")
    return record


def _claim_result(queue_id: str, task_id: str, owner: str, reply: Any) -> GateResult:
    """:func:`gate_result` with the reply last: a claim call's ``decode`` is a partial of it
    with positional arguments only, the cheapest to call."""
    return gate_result(reply, queue_id, task_id, owner)


def gate_result(reply: Any, queue_id: str, task_id: str, owner: str) -> GateResult:
    """Map a claim.lua (or done.lua) reply to its result: the one place that reads claim codes."""
    status = int(reply[0])
    if status in (ClaimStatus.SUCCESS, ClaimStatus.TOOK_OVER):
        _, instance, created, expires, previous = reply
        token = ClaimToken(queue_id, task_id, owner, int(instance), int(created), int(expires))
        if status == ClaimStatus.SUCCESS:
            return Success(token=token)
        return TookOver(previous_owner=as_text(previous), token=token)
    if status == ClaimStatus.ALREADY_CLAIMED:
        return AlreadyClaimed(owner=as_text(reply[1]), expires_at=int(reply[2]))
    if status == ClaimStatus.DONE:
        return AlreadyDone(owner=as_text(reply[3]), instance=int(reply[1]), done_at=int(reply[2]))
    if status == ClaimStatus.GIVEN_UP:
        return GivenUp(
            previous_owner=as_text(reply[3]), takeovers=int(reply[1]), given_up_at=int(reply[2])
        )
    raise BackendError(f"unknown claim status code {status!r} from the claim store")


def rated_gate_result(
    reply: Any, queue_id: str, task_id: str, owner: str, rate: RatePart
) -> GateResult | RatedClaim:
    """Map a claim_rated.lua reply: claim.lua's, then the granted claim's rate verdict."""
    claim = gate_result(reply[:5], queue_id, task_id, owner)
    if not isinstance(claim, (Success, TookOver)):
        return claim
    if len(reply) < 7:
        raise BackendError(
            f"claim_rated.lua answered a granted claim without a verdict: {reply!r:.200}"
        )
    return RatedClaim(claim, rate.decode(reply[5:]))


class ScriptRunner:
    """The claim store's scripts, and the calls of each operation (built and run).

    Its state is set by :class:`~celery_claims.claims.redis.RedisClaimManager`'s constructor.
    """

    prefix: str
    client: RedisClient
    _clock: Clock | None
    _wait: tuple[int, int]
    _queues_key: str
    _known_queues: set[str]
    _queue_keys: dict[str, QueueKeys]
    _many_parts: dict[tuple[str, str], ManyPart]
    _scripts: dict[str, Script]
    _send: Callable[[ScriptCall[Any]], Any] | None

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
                self._many_parts.clear()
            self._queue_keys[queue_id] = keys
        return keys

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
        rate: RatePart | None = None,
        run: int | None = None,
    ) -> ScriptCall[GateResult | RatedClaim]:
        """The checked, unsent call of :meth:`claim_unless_done` (or of :meth:`claim`).

        Registers the queue first (one round trip, once per queue and process). With
        ``honour_done=False`` records are ignored, so a given-up task is only refused by the
        call that gives it up: pass ``max_takeovers`` with ``honour_done=True``. ``run``
        (with ``honour_done``): a completion record of an earlier run is not answered
        (:mod:`celery_claims.runs`).

        With ``rate`` (never on a Redis Cluster, where the rates' keys are in another slot:
        :attr:`folds_rates`), a granted claim's start is counted against its rates in the
        same call (``claim_rated.lua``), and the call's result is a :class:`RatedClaim`;
        such a call goes alone, never in a ``claim_many`` call.

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
        records = "1" if honour_done else "0"
        if run is not None:
            run_text = format_run(run)  # checked even where records are ignored
            records = "r" + run_text if honour_done else records
        self._register(queue_id)
        args: list[Any] = [
            task_id,
            owner,
            lease_ms,
            self._now(),
            records,
            "" if limit is None else limit,
            given_up_ttl_ms,
        ]
        if rate is not None:
            return self._rated_claim_call(keys, args, task_id, owner, rate)
        return ScriptCall(
            self._scripts["claim"],
            keys.claim_keys,
            args,
            partial(_claim_result, queue_id, task_id, owner),
            self._many("claim", keys),
        )

    def _rated_claim_call(
        self, keys: QueueKeys, args: list[Any], task_id: str, owner: str, rate: RatePart
    ) -> ScriptCall[GateResult | RatedClaim]:
        """:meth:`claim_call` with ``rate``: ``claim_rated.lua``, the claim's ``args`` then
        the rate check's."""
        if not self.folds_rates:
            raise InvalidArgument("rate", "a Redis Cluster checks rates in a call of their own")
        return ScriptCall(
            self._scripts["claim_rated"],
            [*keys.claim_keys, *rate.keys],
            [*args, self._rate_pad(), *rate.args],
            partial(
                rated_gate_result,
                queue_id=keys.queue_id,
                task_id=task_id,
                owner=owner,
                rate=rate,
            ),
        )

    @property
    def folds_rates(self) -> bool:
        """Whether a claim can count its start's rates in its own call (:meth:`claim_call`
        with ``rate``): on a standalone or Sentinel store a script may touch keys of any
        hash tag; on a Redis Cluster all of one script's keys must share one slot."""
        return not isinstance(self.client, redis.RedisCluster)

    def _rate_pad(self) -> str:
        return "0" if self._clock is None else str(CALLER_CLOCK_TTL_PAD_MS)

    def _many(self, name: str, keys: QueueKeys) -> ManyPart:
        """How a ``name`` call of queue ``keys`` goes in a ``claim_many`` call (built once
        per operation and queue)."""
        part = self._many_parts.get((name, keys.queue_id))
        if part is None:
            part = ManyPart(self._scripts["claim_many"], keys.claim_keys, MANY_OPS[name])
            self._many_parts[(name, keys.queue_id)] = part
        return part

    def execute(self, call: ScriptCall[_T]) -> _T:
        """Send ``call``, wait for its reply and decode it (one round trip).

        Raises:
            BackendUnavailable: the store could not be reached.
            BackendError: any other store error.
            ClaimTokenError: the call's own refusal (see its operation).
        """
        send = self._send
        try:  # translate_errors(), inline: a context manager's frames cost a call as much
            reply = call.script(keys=call.keys, args=call.args) if send is None else send(call)
        except redis_errors.RedisError as exc:
            raise translated(exc) from exc
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

    def _release_call(self, token: ClaimToken, done_ttl: str) -> ScriptCall[None]:
        require_token(token)
        keys = self.keys(token.queue_id)
        return ScriptCall(
            self._scripts["release"],
            keys.release_keys,
            [token.task_id, token.owner, token.instance, done_ttl, self._now()],
            partial(_token_result, token=token),
        )

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
            self._many("ack_done", keys),
        )

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
