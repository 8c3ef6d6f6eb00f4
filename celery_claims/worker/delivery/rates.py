"""Fleet-wide rates in the worker: a claimed copy waits (``WAITING``) until its rates allow
its start, never blocking the worker.

A task's ``claims_rate`` (``"10/s"``; with ``claims_rate_key``, per key of its arguments) and,
under ``claims_rate_limit_fleetwide``, Celery's own ``rate_limit`` become :class:`Limit` s of
:mod:`celery_claims.rates`. A copy's claim call asks its limits too once the claim is granted
(``claim_rated.lua``; on a Redis Cluster a call of its own right after, ``rate.lua``); a
refused copy waits outside the pool, before its lane: claimed, unacked, renewed by the
keeper, its prefetch slot given back (a window of them closes their queue: ``slots.py``),
``task_held(reason="rate")`` sent, and asked again when the store said its window frees
(``retry_after_ms``, one consumer timer: no polling). Copies with the same limits form a
**group** asked one at a time, oldest first (a refusal answers for all of them); groups due at
once are asked in the order they became due, so one busy key does not starve the others.
docs/rates.md, *The worker integration*.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery.utils.log import get_logger

from celery_claims.claims.calls import RatePart
from celery_claims.config import KeyFunction, LaneSpec, parse_key_declaration
from celery_claims.errors import InvalidArgument
from celery_claims.rates import (
    Limit,
    Rate,
    RateAllowed,
    RateLimited,
    RateResult,
    RedisRateLimiter,
    parse_rate,
)
from celery_claims.worker import signals
from celery_claims.worker.compat import set_request_field
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.keyed import check_key_arguments, key_text, signature_of
from celery_claims.worker.delivery.registry import Registry
from celery_claims.worker.delivery.state import State
from celery_claims.worker.delivery.wiring import Wiring

__all__ = ["RATE_AT_KEY", "RATE_SCOPE", "RateSpec", "WorkerRates", "rate_spec"]

logger = get_logger("celery_claims.worker")

#: The request field (``self.request.claims_rate_at_ms`` in task code) holding when the claim
#: store let a rated copy start, in epoch ms by the store's clock: the start its rates counted.
RATE_AT_KEY = "claims_rate_at_ms"

#: The scope (hash tag) of every rate's key: one slot, so one call counts a start against a
#: task's, a key's and a lane's limits at once, whatever queue delivered it. A claim's own
#: call counts it too on a standalone or Sentinel store (``claim_rated.lua``), where a script
#: may touch any slot; on a Redis Cluster the first check is a call of its own (docs/rates.md).
RATE_SCOPE = "rates"


@dataclass(frozen=True)
class RateSpec:
    """The rate of one task, validated at worker start.

    Attributes:
        task_name: the task.
        rate: at most this many starts per period, fleet-wide.
        where: the attribute it was given as (``claims_rate``, or ``rate_limit`` under
            ``claims_rate_limit_fleetwide``), for logs.
        key_names: the arguments of ``claims_rate_key`` (the rate is then per key).
        key_fn: the callable ``claims_rate_key``, or None.
        signature: the task's signature, to bind a message's arguments.
    """

    task_name: str
    rate: Rate
    where: str = "claims_rate"
    key_names: tuple[str, ...] = ()
    key_fn: KeyFunction | None = None
    signature: Any = None

    @property
    def keyed(self) -> bool:
        """Whether the rate applies per key of the arguments."""
        return bool(self.key_names) or self.key_fn is not None

    def limit_name(self, key: str) -> str:
        """The limit's name in the store: ``task:<name>``, or ``key:<name>:<key>``."""
        return f"key:{self.task_name}:{key}" if self.keyed else f"task:{self.task_name}"


def rate_spec(task: Any, name: str, *, fleetwide: bool) -> RateSpec | None:
    """Validate ``task``'s ``claims_rate`` and ``claims_rate_key`` (None when it has no rate).

    Under ``fleetwide`` (``claims_rate_limit_fleetwide``), a task without ``claims_rate`` takes
    Celery's ``rate_limit`` as its fleet-wide rate.

    Raises:
        InvalidArgument: a rate or key that cannot be used, named ``<task>.<attribute>``.
    """
    raw = getattr(task, "claims_rate", None)
    where = "claims_rate"
    if raw is None and fleetwide and getattr(task, "rate_limit", None):
        raw, where = task.rate_limit, "rate_limit"
    raw_key = getattr(task, "claims_rate_key", None)
    if raw is None:
        if raw_key is not None:
            raise InvalidArgument(f"{name}.claims_rate_key", "is set but claims_rate is not")
        return None
    if getattr(task, "claims", True) is False:
        raise InvalidArgument(f"{name}.{where}", "a fleet-wide rate needs a claimed task")
    rate = parse_rate(raw, name=f"{name}.{where}")
    if raw_key is None:
        return RateSpec(name, rate, where)
    if getattr(raw_key, "__self__", None) is task:
        raw_key = raw_key.__func__  # a function given to the decorator is bound by the task
    key_where = f"{name}.claims_rate_key"
    names, fn = parse_key_declaration(key_where, raw_key)
    signature = signature_of(task)
    check_key_arguments(key_where, name, names, signature)
    return RateSpec(name, rate, where, names, fn, signature)


@dataclass(eq=False)
class _Group:
    """The copies waiting on one set of limits, oldest first."""

    limits: tuple[Limit, ...]
    waiting: deque[tuple[Copy, int]] = field(default_factory=deque)
    #: when the store may allow the next start (``time.monotonic()``)
    due_at: float = 0.0
    #: a check is on its way (its reply decides the head)
    asking: bool = False
    #: already in the due heap
    queued: bool = False
    #: consecutive store errors (backoff)
    errors: int = 0
    #: the limit the store last said its copies wait for
    limit: str = ""

    @property
    def name(self) -> str:
        return ", ".join(f"{limit.name} ({limit.rate})" for limit in self.limits)


class WorkerRates:
    """The rate waits of one worker: one group per set of limits, one timer for all.

    Runs on the consumer's event loop (the gate's outcomes, the timer, the pipe's replies).

    Args:
        w: what the lifecycle's parts share.
        reg: the copies and their states.
        granted: hands a copy its rates allowed on (to its lane or the pool).
    """

    def __init__(self, w: Wiring, reg: Registry, granted: Callable[[Copy, Any], None]) -> None:
        self.w = w
        self.reg = reg
        self.granted = granted
        self.specs: dict[str, RateSpec | None] = {}
        self._signatures: dict[str, Any] = {}
        #: (task name, queue) -> its limits where they need no key, None where they do: the
        #: same for every message, so made once (:meth:`unkeyed_limits`)
        self._unkeyed: dict[tuple[str, str], tuple[Limit, ...] | None] = {}
        self._lanes_by_queue: dict[str, list[LaneSpec]] = {}
        for lane in w.settings.lanes:
            if lane.rate is not None:
                for queue in lane.queues:
                    self._lanes_by_queue.setdefault(queue, []).append(lane)
        self.limiter = RedisRateLimiter(client=w.manager.client, prefix=w.settings.prefix)
        self._groups: dict[tuple[str, ...], _Group] = {}
        #: the copy's current wait (a copy that leaves WAITING and comes back waits anew)
        self._waits: dict[Copy, int] = {}
        self._due: list[tuple[float, int, _Group]] = []
        self._seq = itertools.count()
        self._timer: Any = None
        self._timer_at: float | None = None
        #: the lane each waiting copy goes to next (None: the pool)
        self._lanes: dict[Copy, Any] = {}
        #: the name of the first limit each waiting copy waits on (what operators see)
        self._named: dict[Copy, str] = {}
        #: the consumer's connection is closing: replies still on their way decide nothing
        self.closing = False

    # --- what a copy is limited by -------------------------------------------------------

    def spec_of(self, task: Any, name: str) -> RateSpec | None:
        """The rate of task ``name`` (read once; a task registered after start is checked
        here: a bad rate is logged and the task runs without it, as a bad lease does)."""
        if name not in self.specs:
            try:
                fleetwide = self.w.settings.rate_limit_fleetwide
                self.specs[name] = rate_spec(task, name, fleetwide=fleetwide)
            except InvalidArgument as exc:
                logger.error("%s; no fleet-wide rate applies", exc)
                self.specs[name] = None
        return self.specs[name]

    def rated_lane(self, queue_id: str, task_name: str) -> LaneSpec | None:
        """The lane with a rate a message of ``task_name`` from ``queue_id`` is in, or None."""
        for spec in self._lanes_by_queue.get(queue_id, ()):
            if spec.covers(queue_id, task_name):
                return spec
        return None

    def unkeyed_limits(self, task: Any, name: str, queue_id: str) -> tuple[Limit, ...] | None:
        """:meth:`limits_for` a message of ``task`` from ``queue_id``, made from its name and
        queue alone, before it is decoded; None where they need its arguments (a rate's or a
        rated lane's key). The same for every message of the task and queue: made once."""
        try:
            return self._unkeyed[name, queue_id]
        except KeyError:
            pass
        spec = self.spec_of(task, name)
        lane = self.rated_lane(queue_id, name)
        limits: tuple[Limit, ...] | None = None
        if not ((spec is not None and spec.keyed) or (lane is not None and lane.rate_keyed)):
            made: list[Limit] = []
            if spec is not None:
                made.append(Limit(spec.limit_name(""), spec.rate))
            if lane is not None and lane.rate is not None:
                made.append(Limit(f"lane:{lane.name}", lane.rate))
            limits = tuple(made)
        self._unkeyed[name, queue_id] = limits
        return limits

    def claim_part(self, limits: Sequence[Limit]) -> RatePart | None:
        """The check of ``limits`` to send in the copy's claim call, or None: no limits, or
        a Redis Cluster store (the rates' keys are in a slot of their own there, so a
        claimed copy asks them in a call of its own, :meth:`admit`)."""
        if not limits or not self.w.manager.folds_rates:
            return None
        return self.limiter.claim_part(RATE_SCOPE, limits)

    def limits_for(self, request: Any, queue_id: str) -> tuple[Limit, ...]:
        """The limits a message of ``request`` delivered from ``queue_id`` must pass before
        its lane or the pool (empty: none): its task's rate (per key with
        ``claims_rate_key``), and its lane's (per key with the lane's ``key``).

        Raises:
            KeyRefused: a rate's key cannot be made from its arguments.
        """
        name = request.name
        unkeyed = self.unkeyed_limits(request.task, name, queue_id)
        if unkeyed is not None:
            return unkeyed  # no key to make: the common case
        limits: list[Limit] = []
        spec = self.spec_of(request.task, name)
        if spec is not None:
            key = ""
            if spec.keyed:
                key = key_text(
                    name, spec.key_names, spec.key_fn, spec.signature, request.args, request.kwargs
                )
            limits.append(Limit(spec.limit_name(key), spec.rate))
        lane = self.rated_lane(queue_id, name)
        if lane is not None and lane.rate is not None:
            limit_name = f"lane:{lane.name}"
            if lane.rate_keyed:
                if name not in self._signatures:
                    self._signatures[name] = signature_of(request.task)
                key = key_text(
                    name,
                    lane.key_names,
                    lane.key_fn,
                    self._signatures[name],
                    request.args,
                    request.kwargs,
                )
                limit_name = f"lane:{lane.name}:{key}"
            limits.append(Limit(limit_name, lane.rate))
        return tuple(limits)

    # --- waiting (event loop) ------------------------------------------------------------

    def admit(
        self, copy: Copy, limits: Sequence[Limit], lane: Any, verdict: RateResult | None = None
    ) -> None:
        """Queue a claimed copy (``WAITING``) on its limits; its group is asked now if due.

        ``verdict``: its claim's call asked its limits already (``claim_rated.lua``): an
        allowed start goes to the group's oldest copy (this one, unless older copies wait
        for the same limits), a refusal holds the group until the window frees.
        """
        names = tuple(limit.name for limit in limits)
        group = self._groups.get(names)
        if group is None:
            group = self._groups[names] = _Group(tuple(limits))
        wait = next(self._seq)
        if copy.hold_reason == "rate":
            copy.hold_reason = ""  # it waited before, lost its claim and got it again
        self._waits[copy] = wait
        self._lanes[copy] = lane
        self._named[copy] = limits[0].name
        group.waiting.append((copy, wait))
        if verdict is not None:
            self._counted(group, copy, verdict)
            return
        now = time.monotonic()
        if not group.asking and not group.queued and group.due_at <= now:
            self._ask(group)
        elif not group.asking:
            if group.due_at > now and group.limit:
                # the store said already when the next start may go: it waits, say so now
                self._hold(group, group.limit, round((group.due_at - now) * 1000))
            self._queue(group)

    def _head(self, group: _Group) -> Copy | None:
        """The oldest copy still waiting in ``group`` (others that left are dropped)."""
        while group.waiting:
            copy, wait = group.waiting[0]
            if copy.state is State.WAITING and self._waits.get(copy) == wait:
                return copy
            group.waiting.popleft()
            if self._waits.get(copy) == wait:
                self._forget(copy)
        return None

    def _forget(self, copy: Copy) -> None:
        self._waits.pop(copy, None)
        self._lanes.pop(copy, None)
        self._named.pop(copy, None)

    def _ask(self, group: _Group) -> None:
        head = self._head(group)
        if head is None:
            self._groups.pop(tuple(limit.name for limit in group.limits), None)
            return
        group.asking = True
        try:
            call = self.limiter.acquire_call(RATE_SCOPE, group.limits)
        except InvalidArgument as exc:  # a limit name the store cannot take: never expected
            group.asking = False
            self._failed(group, exc)
            return
        if not self.w.send(call, lambda outcome: self._answered(group, outcome)):
            try:
                outcome: Any = self.w.manager.execute(call)
            except Exception as exc:
                outcome = exc
            self._answered(group, outcome)

    def _counted(self, group: _Group, copy: Copy, verdict: RateResult) -> None:
        """The verdict of ``copy``'s limits, asked in its claim's own call."""
        if not group.asking:
            # the start was counted for the group: its oldest copy takes it
            self._answered(group, verdict)
            return
        # the group's head is being asked: this copy's own verdict decides it alone
        if isinstance(verdict, RateAllowed):
            group.waiting.pop()  # it was just appended
            self.w.counters.incr("rate_allowed")
            self._let_go(copy, verdict)
            return
        self.w.counters.incr("rate_limited")
        self._hold(group, verdict.limit, verdict.retry_after_ms)

    def _let_go(self, copy: Copy, verdict: RateAllowed) -> None:
        """``copy``'s start was counted: to its lane or the pool."""
        # when the store let it start, by the store's clock: task code can read it
        set_request_field(copy.request, RATE_AT_KEY, verdict.at_ms)
        lane = self._lanes.get(copy)
        self._forget(copy)
        self._grant(copy, lane)

    def _answered(self, group: _Group, outcome: Any) -> None:
        group.asking = False
        if self.closing:
            return  # the connection closes: the lifecycle releases the waiting copies
        head = self._head(group)
        if head is None:
            self._ask(group)  # nothing waits any more: the group goes
            return
        now = time.monotonic()
        if isinstance(outcome, RateAllowed):
            group.errors = 0
            group.waiting.popleft()
            next_at = max(outcome.next_at_ms, default=outcome.at_ms)
            next_ms = next_at - outcome.at_ms
            group.due_at = now + next_ms / 1000
            longest = group.limits[outcome.next_at_ms.index(next_at)].name
            group.limit = longest
            self.w.counters.incr("rate_allowed")
            if not group.waiting:
                # an idle group costs nothing here either: the store keeps its next time
                self._groups.pop(tuple(limit.name for limit in group.limits), None)
            else:
                if next_ms > 0:
                    # the store said when the next start may go: the rest wait until then
                    self._hold(group, longest, next_ms)
                self._queue(group)
            self._let_go(head, outcome)
            return
        if isinstance(outcome, RateLimited):
            group.errors = 0
            group.due_at = now + outcome.retry_after_ms / 1000
            self.w.counters.incr("rate_limited")
            self._hold(group, outcome.limit, outcome.retry_after_ms)
            self._queue(group)
            return
        self._failed(group, outcome)

    def _failed(self, group: _Group, error: Any) -> None:
        """The store did not answer: try again later, backing off; never run unchecked."""
        group.errors += 1
        delay_ms = min(
            self.w.settings.unavailable_retry_ms * 2 ** min(group.errors - 1, 10),
            self.w.settings.unavailable_retry_max_ms,
        )
        logger.warning(
            "Rate %s: claim store did not answer (%s); retrying in %.1f s",
            group.name,
            error,
            delay_ms / 1000,
        )
        self.w.counters.incr("rate_unavailable")
        group.due_at = time.monotonic() + delay_ms / 1000
        self._queue(group)

    def _grant(self, copy: Copy, lane: Any) -> None:
        if copy.hold_reason == "rate":
            copy.hold_reason = ""
            # it was reported waiting (task_held): report that it waits no more
            signals.rate_passed.send(
                sender=copy.request.task,
                request=copy.request,
                claim_id=copy.claim_id,
                rate=copy.rate_limits[0].name if copy.rate_limits else "",
                instance=copy.instance,
            )
        self.w.slots.take_back(copy)
        self.granted(copy, lane)

    def _hold(self, group: _Group, limit: str, wait_ms: int) -> None:
        """Report every copy of ``group`` not yet reported as waiting ``wait_ms`` for
        ``limit``; give back their prefetch slots."""
        recheck_s = wait_ms / 1000
        group.limit = limit
        for copy, wait in group.waiting:
            if copy.hold_reason == "rate" or self._waits.get(copy) != wait:
                continue
            if copy.state is not State.WAITING:
                continue
            copy.hold_reason = "rate"
            # its slot back, so that the worker's other queues keep flowing; a window of
            # waiting copies closes their queue, so that the worker does not pull a limited
            # task's whole backlog into memory (slots.py)
            key = copy.key
            self.w.slots.wait_for_rate(copy, copy.queue_id if key is None else key.queue)
            self.w.counters.incr("rate_held")
            request = copy.request
            logger.info(
                "Held %s[%s]: rate %s is used up; claimed, kept unacked, re-checking in %.3f s",
                request.name,
                request.id,
                limit,
                recheck_s,
            )
            signals.task_held.send(
                sender=request.task,
                request=request,
                reason="rate",
                claim_id=copy.claim_id,
                holder=None,
                recheck_s=recheck_s,
                rate=limit,
                instance=copy.instance,
            )

    # --- the timer (event loop) ----------------------------------------------------------

    def _queue(self, group: _Group) -> None:
        if group.queued:
            return
        group.queued = True
        # ties (groups due at once) go in the order they were queued: oldest due first
        heapq.heappush(self._due, (group.due_at, next(self._seq), group))
        self._schedule()

    def _schedule(self) -> None:
        if not self._due or self.w.consumer is None:
            return
        at = self._due[0][0]
        if self._timer is not None and self._timer_at is not None and self._timer_at <= at:
            return
        self._cancel_timer()
        self._timer_at = at
        self._timer = self.w.consumer.timer.call_after(
            max(at - time.monotonic(), 0.0), self._on_timer, priority=6
        )

    def _cancel_timer(self) -> None:
        entry, self._timer, self._timer_at = self._timer, None, None
        if entry is not None:
            with contextlib.suppress(Exception):
                self.w.consumer.timer.cancel(entry)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        now = time.monotonic()
        try:
            while self._due and self._due[0][0] <= now + 0.0005:
                _, _, group = heapq.heappop(self._due)
                group.queued = False
                if not group.asking:
                    self._ask(group)
        except Exception:
            # never lose a waiting copy to a bug: keep it and look again soon
            logger.exception("Rate re-check failed")
        finally:
            self._schedule()

    # --- what operators see (any thread) -------------------------------------------------

    def waiting_per_rate(self) -> dict[str, int]:
        """How many copies wait on each set of limits now (by the first limit's name)."""
        counts: dict[str, int] = {}
        for copy, name in self._named.copy().items():  # dict.copy(): atomic under the GIL
            if copy.state is State.WAITING:
                counts[name] = counts.get(name, 0) + 1
        return counts

    # --- the connection -------------------------------------------------------------------

    def resume(self) -> None:
        """The consumer (re)started: replies decide again."""
        self.closing = False

    def drop_all(self) -> None:
        """Forget every wait (the consumer's connection closes: the lifecycle releases the
        waiting copies' claims, and the broker delivers them again). Reentrant, no logging."""
        self.closing = True
        self._cancel_timer()
        self._groups.clear()
        self._waits.clear()
        self._lanes.clear()
        self._named.clear()
        self._due.clear()
