"""The claim gate: claims every request before the pool runs it (the consumer's side).

The gate wraps ``consumer.on_task_request`` (see :mod:`celery_claims.worker.steps`). Every
path into the pool goes through that attribute (immediate requests through the task strategy,
ETA requests through ``apply_eta_task``, rate-limited ones through ``_limit_move_to_pool``), it
runs in the worker's main process, and it is set before the strategies capture it, so the
wrapper survives connection restarts.

For each request it claims the task (``claim_unless_done``) and hands the outcome to the
lifecycle (:mod:`celery_claims.worker.delivery.lifecycle`), which decides what happens to the copy:
run it, skip it, hold it. Where the claim store is the Redis broker's own server, the claim
was sent already, in the transaction in which kombu recorded the delivery
(:class:`~celery_claims.worker.transport.broker.BrokerRide`): the gate reads its reply. Elsewhere it
queues the claim on the consumer's own connection (:mod:`celery_claims.worker.transport.pipe`: sent
when the event loop is about to poll, in one script call with the other claims and records
of its queue queued meanwhile) and goes on; the copy is decided when the event loop reads the
reply (on the solo pool the pipe reads it at once, if it comes within a few ms: see
:class:`~celery_claims.worker.transport.pipe.InlineStorePipe`; without an event loop, the
manager's blocking client makes the round trip). For a
copy that goes to the pool it sets per-request wrappers of
``on_accepted``, ``on_success``, ``on_failure``, ``on_timeout`` and ``execute_using_pool``
that report to the lifecycle, which runs Celery's own handler (or, for a stale copy, lets
the message go without acking it).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery.utils.log import get_logger

from celery_claims.claims.calls import RatedClaim, ScriptCall
from celery_claims.errors import BackendUnavailable, ClaimError, InvalidArgument, KeyRefused
from celery_claims.fencing import TaskClaim
from celery_claims.model import AlreadyClaimed, AlreadyDone, ClaimToken, GivenUp, Success, TookOver
from celery_claims.rates import Limit
from celery_claims.runs import with_run
from celery_claims.worker.compat import (
    fleet_rate_limits,
    hook_request,
    request_fields,
    set_request_field,
)
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.guard import REQUEST_KEY, SETTLE_KEY, is_guarded
from celery_claims.worker.delivery.keyed import KeyedClaim, KeySpecs
from celery_claims.worker.delivery.lifecycle import Lifecycle
from celery_claims.worker.delivery.state import State
from celery_claims.worker.identity import QueueResolver, attempt_task_id, new_owner
from celery_claims.worker.policy import is_exempt, time_limit_of
from celery_claims.worker.publish.runs import run_of
from celery_claims.worker.runtime import ClaimsRuntime
from celery_claims.worker.settings import ClaimsSettings
from celery_claims.worker.transport.broker import BrokerRide, keep_writes
from celery_claims.worker.transport.pipe import Pipe, consumer_pipe

__all__ = ["ClaimGate"]

logger = get_logger("celery_claims.worker")


#: A pre-claim whose reply has not come (kombu's transaction failed before it).
_NO_REPLY = object()


@dataclass(eq=False)
class _Preclaim:
    """A claim sent in kombu's delivery transaction, waiting for the gate."""

    owner: str
    queue_id: str
    task_key: str
    lease_ms: int
    run: int | None
    rate_limits: tuple[Limit, ...]
    call: ScriptCall[Any]
    reply: Any = _NO_REPLY

    def outcome(self) -> Any:
        """The decoded reply, or the error it is (never raises)."""
        if isinstance(self.reply, Exception):
            return BackendUnavailable(f"claim store error in kombu's transaction: {self.reply}")
        try:
            return self.call.decode(self.reply)
        except Exception as exc:
            return exc


class _Leases:
    """Each task's claim lease: its ``claims_lease_ms``, else the worker's (read once a task)."""

    def __init__(self, settings: ClaimsSettings) -> None:
        self.settings = settings
        self._by_name: dict[str, int] = {}

    def of(self, name: str, task: Any) -> int:
        lease = self._by_name.get(name)
        if lease is None:
            lease = self.settings.lease_ms
            raw = getattr(task, "claims_lease_ms", None)
            if raw is not None:
                try:
                    lease = self.settings.check_task_lease(name, raw)
                except InvalidArgument as exc:
                    # tasks registered after start were not validated then; a bad value must
                    # not stop the worker, so the default lease applies
                    logger.error("%s; using claims_lease_ms=%d", exc, lease)
            self._by_name[name] = lease
        return lease


class ClaimGate:
    """Claims each request before the pool runs it (see the module docstring).

    Args:
        consumer: the worker's ``Consumer``.
        runtime: the worker's claim state (``worker.claims``).
        inner: Celery's own ``on_task_request`` (the consumer's, before the gate).
    """

    def __init__(self, consumer: Any, runtime: ClaimsRuntime, inner: Callable[[Any], Any]):
        self.consumer = consumer
        self.runtime = runtime
        self.life: Lifecycle = runtime.life
        self.inner = inner
        self.settings = runtime.settings
        self.queues = QueueResolver(consumer.app)
        self.leases = _Leases(self.settings)
        self._loop_thread = -1
        self._pipe: Pipe | None = None
        self._pipe_checked = False
        self._stopping = False
        self._pre: dict[Any, _Preclaim] = {}
        self.keys = KeySpecs(self.settings)
        self.life.bind(consumer, self._to_pool, self._claim, self._send)
        if self.settings.rate_limit_fleetwide:
            # Celery's rate_limit is counted fleet-wide by the lifecycle: no sleeping on it
            fleet_rate_limits(consumer, self._fleet_rated)

    # --- entry point ------------------------------------------------------------------------

    def __call__(self, request: Any) -> Any:
        """The wrapped ``on_task_request``."""
        task, name = request.task, request.name
        if is_exempt(task, name):
            return self.inner(request)
        self._loop_thread = self.life.on_loop()
        if self._pre and self._preclaimed(request):
            return None
        # no claim rode kombu's write (or it failed there): claimed here under a new owner
        try:
            queue_id = self.queues.queue_of(request.delivery_info)
            fields = request_fields(request)
            task_key = attempt_task_id(request.id, fields)
        except Exception:
            # unreadable routing or attempt: never run unclaimed; the message stays unacked
            # and the broker redelivers it
            logger.exception("Claim gate cannot read %s[%s]", name, request.id)
            return None
        # a canvas part's owner names its run, so its completion record does (runs.py)
        run = run_of(fields)
        owner = with_run(new_owner(self.runtime.hostname), run)
        lanes = self.runtime.lanes
        try:
            key = self._key_of(request, queue_id, task_key, owner)
            # a keyed lane's key is made before the claim: a message without one is refused
            # (recorded as failed), never claimed and left waiting
            lane_key = lanes.key_of(queue_id, request) if lanes is not None else ""
            rate_limits = self.life.rates.limits_for(request, queue_id)  # and a rate's key
        except KeyRefused as exc:
            self.life.unrun.refuse(request, exc, queue_id, task_key)
            return None
        copy = self.life.receive(
            request,
            owner=owner if key is None else key.owner(owner),
            queue_id=queue_id if key is None else key.claim_queue,
            task_key=task_key if key is None else key.field,
            lease_ms=self.leases.of(name, task),
            guarded=is_guarded(task),
            key=key,
            lane_key=lane_key,
            run=run,
        )
        copy.rate_limits = rate_limits
        self._claim(copy)
        return None

    def _preclaimed(self, request: Any) -> bool:
        """Decide ``request`` by the claim that rode kombu's delivery transaction; False
        where none did, or it failed there."""
        pre = self._pre.pop(getattr(request.message, "delivery_tag", None), None)
        # Celery hands each delivery to the gate within kombu's delivery call, so any other
        # pre-claim left belongs to a message Celery dropped
        self._drop_leftovers()
        if pre is None or pre.reply is _NO_REPLY or isinstance(pre.reply, Exception):
            return False
        copy = self.life.receive(
            request,
            owner=pre.owner,
            queue_id=pre.queue_id,
            task_key=pre.task_key,
            lease_ms=pre.lease_ms,
            guarded=is_guarded(request.task),
            run=pre.run,
        )
        # no key to make (claim_for sends no claim for such a task): made there already
        copy.rate_limits = pre.rate_limits
        self._settle(copy, pre.outcome())
        return True

    def _key_of(self, request: Any, queue_id: str, task_key: str, owner: str) -> KeyedClaim | None:
        """The keyed claim of ``request`` (None for a task without ``claims_key``).

        Raises:
            KeyRefused: the key cannot be made from the message (see ``keyed.py``).
        """
        spec = self.keys.of(request.task, request.name)
        if spec is None:
            return None
        return self.keys.claim(spec, request, queue_id, task_key, len(owner.encode("utf-8")))

    def _fleet_rated(self, task: Any, name: str) -> bool:
        # under claims_rate_limit_fleetwide every fleet-rated task is off Celery's bucket
        # (its claims_rate wins over its rate_limit)
        return self.life.rates.spec_of(task, name) is not None

    @property
    def store_pipe(self) -> Pipe | None:
        """The consumer's claim store pipe once the first request made it (None before, or
        where the store needs the blocking client)."""
        return self._pipe

    def pipe(self) -> Pipe | None:
        """The consumer's claim store pipe, when the caller may use it (else None).

        Only the consumer's thread, while the consumer runs, uses the pipe; a thread pool's
        callbacks and a worker shutting down use the manager's blocking client.
        """
        if self._stopping or threading.get_ident() != self._loop_thread:
            return None
        if self._pipe is None and not self._pipe_checked:
            self._pipe_checked = True
            # watched by the consumer's event loop; without one (gevent, eventlet: no hub) the
            # blocking client is used; on solo, where the body runs on the loop, replies inline
            hub, solo = getattr(self.consumer, "hub", None), self.runtime.pool_name == "solo"
            self._pipe = consumer_pipe(self.runtime.manager, hub, inline=solo)
        return self._pipe

    def _claim_call(
        self,
        queue_id: str,
        task_key: str,
        owner: str,
        lease_ms: int,
        *,
        keyed: bool = False,
        limits: tuple[Limit, ...] = (),
        run: int | None = None,
    ) -> ScriptCall[Any]:
        return self.runtime.manager.claim_call(
            queue_id,
            task_key,
            owner,
            lease_ms,
            honour_done=True,
            # a key's takeovers are those of several tasks: none of them is poison by that
            max_takeovers=None if keyed else self.settings.max_takeovers,
            given_up_ttl_ms=self.settings.done_ttl_ms,
            # a rated copy's first rate check goes in its claim's call (not on a Cluster)
            rate=self.life.rates.claim_part(limits) if limits else None,
            # a later run of a canvas part is not turned away by an earlier run's record;
            # a key's record is the key's, whatever the run
            run=None if keyed else run,
        )

    # --- claims riding kombu's delivery transaction -----------------------------------------

    def claim_for(self, message: Any) -> ScriptCall[Any] | None:
        """The claim to send with kombu's record of ``message``'s delivery, or None.

        None for what the gate claims later or not at all: an ETA or rate-limited task (it
        reaches the gate when due), an exempt or unknown one, an unreadable message. Called
        by kombu's ``QoS.append`` on the consumer's thread, just before the message goes to
        Celery's strategy, which hands it to the gate in the same call unless Celery drops it
        (revoked, expired, invalid): a pre-claim still here at the next delivery (or the next
        request) is such a message's, and its claim is released.
        """
        self._drop_leftovers()
        try:
            headers = message.headers
            name, task_id = headers.get("task"), headers.get("id")
            if not isinstance(name, str) or not isinstance(task_id, str) or headers.get("eta"):
                return None
            task = self.consumer.app.tasks.get(name)
            if task is None or is_exempt(task, name):
                return None
            if getattr(task, "claims_key", None) is not None:
                return None  # keyed: its key is made from the decoded arguments, in the gate
            if (
                task.rate_limit
                and not self.consumer.disable_rate_limits
                and not self._fleet_rated(task, name)
            ):
                return None  # it reaches the gate from Celery's token bucket
            lease_ms = self.leases.of(name, task)
            queue_id = self.queues.queue_of(message.delivery_info)
            lanes = self.runtime.lanes
            lane = lanes.lane_of(queue_id, name) if lanes is not None else None
            if lane is not None and lane.spec.keyed:
                return None  # so is a keyed lane's key
            limits = self.life.rates.unkeyed_limits(task, name, queue_id)
            if limits is None:
                return None  # and a rate's key
            task_key = attempt_task_id(task_id, headers)
            run = run_of(headers)
            owner = with_run(new_owner(self.runtime.hostname), run)
            call = self._claim_call(queue_id, task_key, owner, lease_ms, limits=limits, run=run)
            pre = _Preclaim(owner, queue_id, task_key, lease_ms, run, limits, call)
        except Exception:
            return None  # the gate claims it on its own (or reports what is wrong)
        self._pre[message.delivery_tag] = pre
        return pre.call

    def claimed(self, message: Any, reply: Any) -> None:
        """The reply of :meth:`claim_for`'s call (or the error it ended with)."""
        pre = self._pre.get(message.delivery_tag)
        if pre is not None:
            pre.reply = reply

    def _drop_leftovers(self) -> None:
        """Release the claims of pre-claimed messages Celery never handed to the gate."""
        while self._pre:
            _, pre = self._pre.popitem()
            self._release_unused(pre.outcome())

    # --- the gate's own claim ---------------------------------------------------------------

    def _claim(self, copy: Copy) -> None:
        """Claim ``copy`` (one round trip) and hand the outcome to the lifecycle.

        On the consumer's pipe the claim is only queued here (it is sent when the loop is
        about to poll): the outcome comes when the event loop reads the reply
        (:meth:`_claimed`), and the loop goes on meanwhile.
        """
        outcome: Any
        try:
            call = self._claim_call(
                copy.queue_id,
                copy.task_key,
                copy.owner,
                copy.lease_ms,
                keyed=copy.key is not None,
                limits=copy.rate_limits,
                run=copy.run,
            )
            pipe = self.pipe()
            if pipe is not None:
                try:
                    # sent when the loop is about to poll, in one script call with the other
                    # claims and records of the queue that pass (or passes, under load) made
                    pipe.defer(call, functools.partial(self._claimed, copy))
                    return
                except ClaimError as exc:  # could not connect: nothing was sent
                    outcome = exc
            else:
                try:
                    outcome = self.runtime.manager.execute(call)
                except ClaimError as exc:
                    outcome = exc
        except Exception as exc:
            outcome = exc
        self._settle(copy, outcome)

    def _send(self, call: ScriptCall[Any], callback: Callable[[Any], None]) -> bool:
        """Queue ``call`` on the pipe (as a claim is), its outcome to ``callback`` on the
        event loop; False (nothing sent) where the pipe cannot be used now: the caller writes
        it blocking."""
        pipe = self.pipe()
        if pipe is None:
            return False
        try:
            pipe.defer(call, callback)
        except ClaimError:  # could not connect: nothing was sent
            return False
        return True

    def _claimed(self, copy: Copy, outcome: Any) -> None:
        """The reply to a claim sent on the pipe (event loop)."""
        if self._stopping or copy.state not in (State.RECEIVED, State.HELD):
            # the consumer's connection closed while the claim was on its way: the copy is
            # gone (the broker delivers the message again), and a claim it got would only
            # hold that delivery until its lease ran out
            self._release_unused(outcome)
            return
        self._settle(copy, outcome)

    def _release_unused(self, outcome: Any) -> None:
        if isinstance(outcome, RatedClaim):
            # a start its rates counted goes unused: the rate undershoots by one, never over
            outcome = outcome.claim
        token = getattr(outcome, "token", None)
        if isinstance(outcome, (Success, TookOver)) and token is not None:
            try:
                self.runtime.manager.release(token)
            except ClaimError as exc:
                # it is not renewed: the lease runs out by itself
                logger.debug("Claim %s/%s: release failed: %s", token.queue_id, token.task_id, exc)

    def _settle(self, copy: Copy, outcome: Any) -> None:
        try:
            self._decide(copy, outcome)
        except Exception as exc:
            if copy.token is not None:
                raise  # raised by the pool hand-off itself: Celery's own handling applies
            # a bug must neither run the task unclaimed nor drop it: hold it and try again;
            # if even that fails the message stays unacked and the broker redelivers it
            logger.exception("Claim gate failed on %s[%s]", copy.request.name, copy.request.id)
            self.life.holds.hold(copy, "unavailable", holder=None, error=exc)

    def _decide(self, copy: Copy, outcome: Any) -> None:
        key = copy.key
        rate = None
        if isinstance(outcome, RatedClaim):
            # the claim is granted, and its call counted the start or said how long to wait
            outcome, rate = outcome.claim, outcome.rate
        if isinstance(outcome, (Success, TookOver)):
            lanes = self.runtime.lanes
            queue = copy.queue_id if key is None else key.queue
            lane = lanes.lane_of(queue, copy.request.name) if lanes is not None else None
            self.life.acquired(copy, outcome, lane, rate)
        elif isinstance(outcome, AlreadyDone):
            # a keyed copy finds its own attempt's record, or the key's (claims_key_done_ttl)
            own = key is None or key.is_own(outcome.owner)
            self.life.unrun.skip(copy, outcome, "done" if own else "key_done")
        elif isinstance(outcome, GivenUp):
            # a poison task: its copies kept crashing their workers (claims_max_takeovers)
            self.life.unrun.skip(copy, outcome, "given_up")
        elif isinstance(outcome, AlreadyClaimed):
            policy = "wait" if key is None else key.policy(outcome.owner)
            if policy == "skip":
                self.life.unrun.skip(copy, outcome, "key_held")
            elif policy == "reschedule":
                self.life.unrun.reschedule(copy, outcome)
            else:
                # held; or, acknowledged at claim with its journal entry, acked unrun
                self.life.unrun.held(copy, outcome)
        elif isinstance(outcome, BackendUnavailable):
            self.life.holds.hold(copy, "unavailable", holder=None, error=outcome)
        else:
            # an unexpected store reply or a bug: never run unclaimed, never drop; retry later
            logger.error("Claim %s: claim store error: %r", copy.claim_id, outcome)
            self.life.holds.hold(copy, "unavailable", holder=None, error=outcome)

    # --- to the pool ------------------------------------------------------------------------

    def _to_pool(self, copy: Copy) -> None:
        request = copy.request
        assert copy.token is not None
        # The request dict is what the pool hands to the tracer (pickled to a prefork child),
        # which builds ``self.request`` from it: this is how task code sees its claim.
        set_request_field(
            request,
            REQUEST_KEY,
            TaskClaim.of(copy.token, copy.lease_ms, mark_start=copy.mark_start),
        )
        settle = self.life.done.pool_settle(copy)
        copy.pool_settles = settle is not None
        set_request_field(request, SETTLE_KEY, settle)
        # read now: `celery control time_limit` may have changed the task's since it arrived
        copy.time_limit_s = time_limit_of(request, request.task, self.runtime.time_limits)
        hook_request(request, _Hooks(copy, self.life))  # the pool's reports go to the copy
        self.inner(request)

    # --- connection restarts and shutdown ---------------------------------------------------

    def resume(self) -> None:
        """The consumer (re)started: use the event loop's pipe again, and on the Redis
        broker, where the claim store is its server, send claims and completions with kombu's
        own writes on the new channel; elsewhere send kombu's writes on a kept connection
        (:func:`~celery_claims.worker.transport.broker.keep_writes`)."""
        self._stopping = False
        self.life.loop_started()
        ride = None
        if self.life.ride_acks:
            ride = BrokerRide.of_consumer(self.consumer, self.runtime.manager.client)
        if ride is not None:
            ride.hook_append(self.claim_for, self.claimed)
            ride.hook_ack(self.life.done.take_ack)
        else:
            # a store apart on a Redis broker: kombu's own writes, on a kept connection
            keep_writes(getattr(getattr(self.consumer, "task_consumer", None), "channel", None))

    def drop_connection_state(self) -> None:
        """Forget what belongs to the closing connection (reentrant, no logging)."""
        self._stopping = True
        self.life.rates.closing = True  # rate replies drained below decide nothing
        with contextlib.suppress(Exception):
            self._drop_leftovers()
        if self._pipe is not None:
            # claims on their way are answered before the state goes, so that the claims
            # they got are released (stop must never raise: it may run while the worker
            # shuts down)
            with contextlib.suppress(Exception):
                self._pipe.drain()
            with contextlib.suppress(Exception):
                self._pipe.close()
        self.life.connection_lost()


class _Hooks:
    """The pool's reports on one copy, to the lifecycle (:class:`RequestHooks`).

    The request keeps its hooks, and the copy its request: the hooks let go of the copy once
    the pool reported its last (:meth:`reported`), so that no cycle is left for the garbage
    collector. A report after that finds no copy: a late start is still marked (:meth:`accepted`);
    any other, which no pool sends, runs Celery's handler as the ended copy's lifecycle did,
    unless the copy was fenced (its ack could delete the live owner's message).
    """

    __slots__ = ("copy", "late_handler", "late_start", "life")

    def __init__(self, copy: Copy, life: Lifecycle) -> None:
        self.copy: Copy | None = copy
        self.life = life
        self.late_start: ClaimToken | None = None
        self.late_handler = False

    def accepted(self) -> None:
        if self.copy is not None:
            self.life.started(self.copy)
        elif self.late_start is not None:
            self.life.mark_started(self.late_start)

    def succeeded(self, handler: Callable[[], object]) -> None:
        if self.copy is not None:
            _report(self.copy, self.life.done.succeeded, handler)
        else:
            self._late("a success", handler)

    def failed(self, exc: BaseException | None, handler: Callable[[], object]) -> None:
        life = self.life
        if self.copy is not None:
            _report(self.copy, lambda c, h: life.failed(c, exc, h), handler)
        else:
            self._late(f"a failure ({type(exc).__name__})", handler)

    def timed_out(self, soft: bool, handler: Callable[[], object]) -> None:
        life = self.life
        if self.copy is not None:
            _report(self.copy, lambda c, h: life.timed_out(c, soft, h), handler)
        elif soft:
            handler()  # Celery's soft time limit handler only logs
        else:
            self._late("a hard time limit", handler)

    def revoked(self) -> None:
        if self.copy is not None:
            self.life.revoked(self.copy)

    def reported(self) -> None:
        copy, self.copy = self.copy, None
        if copy is None:
            return
        self.late_handler = not copy.fenced
        if copy.mark_start and not copy.guarded:
            # prefork may deliver the start after the result: it is marked all the same
            self.late_start = copy.token

    def _late(self, what: str, handler: Callable[[], object]) -> None:
        """A report after the pool's last on a request (no pool sends one): Celery's
        handler runs, as it did for an ended copy, whatever the claim store would say;
        never for a fenced copy, whose ack could delete the live owner's message."""
        logger.warning("Claim gate: %s reported after the pool's last report", what)
        if self.late_handler:
            handler()


def _report(
    copy: Copy,
    event: Callable[[Copy, Callable[[], object]], None],
    celery_handler: Callable[[], object],
) -> None:
    """Tell the lifecycle how the copy ended; Celery's handler runs whatever happens there.

    The lifecycle calls ``celery_handler`` itself (before or after its own store write, or
    not at all for a stale copy). If the lifecycle fails, a bug or the store, the handler
    still runs once: Celery's ack and ``task_ready`` never depend on the claim store.
    """
    ran = False

    def handler() -> object:
        nonlocal ran
        ran = True
        return celery_handler()

    try:
        event(copy, handler)
    except Exception:
        logger.exception("Claim %s: completion handling failed", copy.claim_id)
        if not ran and not copy.fenced:
            celery_handler()
