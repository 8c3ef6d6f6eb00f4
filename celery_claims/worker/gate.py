"""The claim gate: a consumer bootstep that claims every request before the pool runs it.

The gate wraps ``consumer.on_task_request`` in the bootstep's ``__init__``. Every path into
the pool goes through that attribute (immediate requests through the task strategy, ETA
requests through ``apply_eta_task``, rate-limited ones through ``_limit_move_to_pool``), it
runs in the worker's main process, and it is set before the strategies capture it, so the
wrapper survives connection restarts. Outcomes:

- acquired (``Success``/``TookOver``): wrap the request's ``on_success``/``on_failure``/
  ``on_timeout``/``execute_using_pool`` so completion or release happens exactly once, then
  hand it to the pool;
- done (``AlreadyDone``): acknowledge without running; the stored result is left alone;
- held (``AlreadyClaimed``) or the store unreachable (``BackendUnavailable``): keep the message
  unacked and check again on a timer, raising the prefetch like Celery does for ETA tasks.
  Acking a copy of a task that is held elsewhere would lose the task if the holder then died
  (a Redis broker *moves* the message on restore), so a held copy is only ever acked once the
  holder has recorded completion, or run once the holder's lease has expired.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import bootsteps
from celery.exceptions import Ignore, Reject, Retry, TaskRevokedError
from celery.utils.log import get_logger
from celery.worker.state import task_ready

from celery_claims.errors import BackendUnavailable, ClaimError, InvalidArgument
from celery_claims.fencing import TaskClaim
from celery_claims.model import AlreadyClaimed, AlreadyDone, Success, TookOver
from celery_claims.worker import signals
from celery_claims.worker.guard import REQUEST_KEY, StaleCopy
from celery_claims.worker.identity import QueueResolver, attempt_of, claim_task_id, new_owner
from celery_claims.worker.keeper import ActiveClaim, ClaimsRuntime, Delivery, HeldCopy
from celery_claims.worker.pipe import StorePipe
from celery_claims.worker.settings import ClaimsSettings

__all__ = ["ClaimGate", "Gate", "check_task_policies", "is_exempt"]

logger = get_logger("celery_claims.worker")

#: Task name prefixes the gate never claims: Celery's own tasks and this package's.
EXEMPT_PREFIXES = ("celery.", "celery_claims.")

#: Exceptions that end an attempt with a successor message (or none needed): record done.
#: ``Retry`` has published the next attempt; ``Ignore`` is what ``Task.replace`` raises after
#: publishing the replacement (and a task raising it asks for no re-run).
_DONE_EXCEPTIONS = (Retry, Ignore)


def is_exempt(task: Any, name: str) -> bool:
    """True if the gate lets ``task`` through unclaimed (Celery's tasks, ours, opt-outs)."""
    if name.startswith(EXEMPT_PREFIXES):
        return True
    return getattr(task, "claims", True) is False


def check_task_policies(app: Any, settings: ClaimsSettings) -> None:
    """Validate the per-task ``claims`` and ``claims_lease_ms`` attributes of every task.

    Raises:
        InvalidArgument: an attribute has the wrong type or an unusable value.
    """
    for name, task in sorted(app.tasks.items()):
        flag = getattr(task, "claims", True)
        if not isinstance(flag, bool):
            raise InvalidArgument(f"{name}.claims", f"must be True or False, got {flag!r:.80}")
        lease = getattr(task, "claims_lease_ms", None)
        if lease is not None:
            settings.check_task_lease(name, lease)


#: The request methods the gate wraps per request (instance attributes).
_WRAPPED = ("on_success", "on_failure", "on_timeout", "execute_using_pool")


def _unwrap(exc: BaseException | None) -> BaseException | None:
    # the prefork pool sends exceptions back wrapped for pickling
    inner = getattr(exc, "exc", None)
    if type(exc).__name__ == "ExceptionWithTraceback" and isinstance(inner, BaseException):
        return inner
    return exc


@dataclass(eq=False, slots=True)
class _Admission:
    """One claim attempt of a delivery, waiting for the store's answer."""

    request: Any
    owner: str
    held: HeldCopy | None
    queue_id: str
    claim_id: str
    lease_ms: int


class ClaimGate:
    """Claims each request before the pool runs it (see the module docstring).

    Args:
        consumer: the worker's ``Consumer``.
        runtime: the worker's claim state (``worker.claims``).
        inner: the original ``on_task_request``.
    """

    def __init__(self, consumer: Any, runtime: ClaimsRuntime, inner: Callable[[Any], Any]):
        self.consumer = consumer
        self.runtime = runtime
        self.inner = inner
        self.settings = runtime.settings
        self.queues = QueueResolver(consumer.app)
        self._leases: dict[str, int] = {}
        self.lanes = runtime.lanes
        self._loop_thread = -1
        self._pipe: StorePipe | None = None
        self._pipe_checked = False
        self._stopping = False
        if self.lanes is not None:
            self.lanes.bind(consumer, self._dispatch)
        runtime.on_waiting_lost = self._waiting_lost

    # --- entry point ------------------------------------------------------------------------

    def __call__(self, request: Any) -> Any:
        """The wrapped ``on_task_request``."""
        if is_exempt(request.task, request.name):
            return self.inner(request)
        self._loop_thread = threading.get_ident()
        self._admit(request, owner=new_owner(self.runtime.hostname), held=None)
        return None

    @property
    def store_pipe(self) -> StorePipe | None:
        """The consumer's claim store pipe once the first request made it (None before, or
        where the store needs the blocking client)."""
        return self._pipe

    def pipe(self) -> StorePipe | None:
        """The consumer's claim store pipe, when the caller may use it (else None).

        Only the consumer's thread, while the consumer runs, uses the pipe; a thread pool's
        callbacks and a worker shutting down use the manager's blocking client.
        """
        if self._stopping or threading.get_ident() != self._loop_thread:
            return None
        if self._pipe is None and not self._pipe_checked:
            self._pipe_checked = True
            # the hub's timer runs on this thread; without an event loop (gevent, eventlet)
            # the worker's timer is a thread of its own, and the blocking client is used
            hub = getattr(self.consumer, "hub", None)
            self._pipe = StorePipe.for_manager(
                self.runtime.manager,
                getattr(hub, "timer", None),
                timeout_s=self.settings.socket_timeout_ms / 1000,
            )
        return self._pipe

    def _lease_ms(self, request: Any) -> int:
        name = request.name
        lease = self._leases.get(name)
        if lease is None:
            lease = self.settings.lease_ms
            raw = getattr(request.task, "claims_lease_ms", None)
            if raw is not None:
                try:
                    lease = self.settings.check_task_lease(name, raw)
                except InvalidArgument as exc:
                    # tasks registered after start were not validated then; a bad value must
                    # not stop the worker, so the default lease applies
                    logger.error("%s; using claims_lease_ms=%d", exc, lease)
            self._leases[name] = lease
        return lease

    def _admit(self, request: Any, *, owner: str, held: HeldCopy | None) -> None:
        """Claim ``request`` (one round trip) and act on the outcome."""
        try:
            queue_id = self.queues.queue_of(request.delivery_info)
            task_key = claim_task_id(request.id, attempt_of(request.request_dict))
            admission = _Admission(
                request, owner, held, queue_id, f"{queue_id}/{task_key}", self._lease_ms(request)
            )
            call = self.runtime.manager.claim_call(
                queue_id, task_key, owner, admission.lease_ms, honour_done=True
            )
        except BackendUnavailable as exc:
            self._hold(request, owner, held, "unavailable", request.id, None, exc)
            return
        except Exception as exc:
            # a bug must neither run the task unclaimed nor drop it: hold it and try again;
            # if even that fails the message stays unacked and the broker redelivers it
            logger.exception("Claim gate failed on %s[%s]", request.name, request.id)
            with contextlib.suppress(Exception):
                self._hold(request, owner, held, "unavailable", request.id, None, exc)
            return
        pipe = self.pipe()
        if pipe is not None:
            outcome: Any = pipe.call(call)
        else:
            try:
                outcome = self.runtime.manager.execute(call)
            except ClaimError as exc:
                outcome = exc
        self._decide(admission, outcome)

    def _decide(self, admission: _Admission, outcome: Any) -> None:
        request, owner, held = admission.request, admission.owner, admission.held
        claim_id = admission.claim_id
        try:
            if isinstance(outcome, (Success, TookOver)):
                self._release_hold(held)
                self._run(request, outcome, admission.lease_ms, claim_id, admission.queue_id)
            elif isinstance(outcome, AlreadyDone):
                self._release_hold(held)
                self._skip_done(request, outcome, claim_id)
            elif isinstance(outcome, AlreadyClaimed):
                self._hold(request, owner, held, "held", claim_id, outcome.owner, None)
            elif isinstance(outcome, BackendUnavailable):
                self._hold(request, owner, held, "unavailable", claim_id, None, outcome)
            elif isinstance(outcome, ClaimError):
                # an unexpected store reply: never run unclaimed, never drop; retry later
                logger.error("Claim %s: claim store error: %s", claim_id, outcome)
                self._hold(request, owner, held, "unavailable", claim_id, None, outcome)
            else:  # pragma: no cover - the outcome union is closed
                raise AssertionError(f"unexpected claim outcome {outcome!r}")
        except Exception as exc:
            if isinstance(getattr(request, "claim", None), ActiveClaim):
                raise  # raised by the pool hand-off itself: Celery's own handling applies
            # a bug must neither run the task unclaimed nor drop it: hold it and try again;
            # if even that fails the message stays unacked and the broker redelivers it
            logger.exception("Claim gate failed on %s[%s]", request.name, request.id)
            with contextlib.suppress(Exception):
                self._hold(request, owner, held, "unavailable", claim_id, None, exc)

    # --- acquired ---------------------------------------------------------------------------

    def _run(
        self, request: Any, result: Success | TookOver, lease_ms: int, claim_id: str, queue_id: str
    ) -> None:
        runtime = self.runtime
        took_over = isinstance(result, TookOver)
        claim = ActiveClaim(
            token=result.token,
            claim_id=claim_id,
            lease_ms=lease_ms,
            request=request,
            delivery=Delivery.of(request.message) if self.settings.refresh_unacked else None,
        )
        runtime.track(claim)
        runtime.counters.incr("took_over" if took_over else "acquired")
        if isinstance(result, TookOver):
            logger.info(
                "Claim %s: took over from %s (instance %d)",
                claim_id,
                result.previous_owner,
                claim.instance,
            )
        request.claim = claim
        self._wrap(request, claim)
        signals.claim_acquired.send(
            sender=request.task,
            request=request,
            token=claim.token,
            took_over=took_over,
            previous_owner=result.previous_owner if isinstance(result, TookOver) else None,
        )
        lane = self.lanes.lane_of(queue_id, request.name) if self.lanes is not None else None
        if lane is None:
            self._dispatch(request, claim)
        else:
            self.lanes.admit(lane, request, claim)  # type: ignore[union-attr]

    def _dispatch(self, request: Any, claim: ActiveClaim) -> None:
        # The request dict is what the pool hands to the tracer (pickled to a prefork child),
        # which builds ``self.request`` from it: this is how task code sees its claim.
        request.request_dict[REQUEST_KEY] = TaskClaim.of(claim.token, claim.lease_ms)
        self.inner(request)

    def _wrap(self, request: Any, claim: ActiveClaim) -> None:
        # Instance attributes: Celery's generated Request subclass overrides these methods on
        # the class, but the pool call looks them up on the instance at dispatch time.
        finish = self.runtime.finish
        on_success = request.on_success
        on_failure = request.on_failure
        on_timeout = request.on_timeout
        execute_using_pool = request.execute_using_pool

        def claims_on_success(failed__retval__runtime: Any, **kwargs: Any) -> Any:
            if failed__retval__runtime[0]:
                # a failed trace goes on to request.on_failure, which is wrapped too
                return on_success(failed__retval__runtime, **kwargs)
            pipe = self.pipe()
            if pipe is None:
                _guard(finish, claim, done=True, why="succeeded")
                return on_success(failed__retval__runtime, **kwargs)
            # the completion is written to the store before Celery's handler acks; its reply is
            # read later (docs/celery.md, "The consumer's store connection")
            self.runtime.finish_async(
                claim,
                pipe,
                why="succeeded",
                then=functools.partial(on_success, failed__retval__runtime, **kwargs),
            )
            return None

        def claims_on_failure(exc_info: Any, *args: Any, **kwargs: Any) -> Any:
            exc = _unwrap(getattr(exc_info, "exception", None))
            if claim.fenced and not isinstance(exc, Ignore):
                # A stale copy (stopped, or failed after another worker took it over):
                # Celery's own handler would store FAILURE or REVOKED over the new owner's
                # result. Only the message goes; the new owner's copy is the live one.
                _guard(finish, claim, done=False, why=f"stale copy ended ({type(exc).__name__})")
                return _drop_stale(request, claim, exc)
            if isinstance(exc, StaleCopy):
                _guard(finish, claim, done=True, why="stale copy ended")
            elif isinstance(exc, _DONE_EXCEPTIONS):
                _guard(finish, claim, done=True, why=type(exc).__name__.lower())
            elif isinstance(exc, Reject):
                _guard(finish, claim, done=False, why="rejected")
            else:
                _guard(finish, claim, done=False, why=f"failed ({type(exc).__name__})")
            return on_failure(exc_info, *args, **kwargs)

        def claims_on_timeout(soft: bool, timeout: Any) -> Any:
            if not soft:
                _guard(finish, claim, done=False, why="hard time limit")
                if claim.fenced:
                    return None  # Celery would store a FAILURE over the new owner's result
            return on_timeout(soft, timeout)

        def claims_execute_using_pool(pool: Any, **kwargs: Any) -> Any:
            claim.dispatched = True
            try:
                return execute_using_pool(pool, **kwargs)
            except TaskRevokedError:
                # revoked before it ran: Celery acks it without calling any callback
                self.runtime.counters.incr("revoked_released")
                _guard(finish, claim, done=False, why="revoked")
                raise

        request.on_success = claims_on_success
        request.on_failure = claims_on_failure
        request.on_timeout = claims_on_timeout
        request.execute_using_pool = claims_execute_using_pool

    # --- done -------------------------------------------------------------------------------

    def _skip_done(self, request: Any, record: AlreadyDone, claim_id: str) -> None:
        self.runtime.counters.incr("skipped_done")
        logger.info(
            "Skipped %s[%s]: claim %s already done by %s (instance %d); acked without running",
            request.name,
            request.id,
            claim_id,
            record.owner,
            record.instance,
        )
        # only the message goes: the result the first run stored stays as it is
        request.acknowledge()
        task_ready(request)
        signals.task_skipped.send(
            sender=request.task, request=request, reason="done", claim_id=claim_id, record=record
        )

    # --- held -------------------------------------------------------------------------------

    def _hold(
        self,
        request: Any,
        owner: str,
        held: HeldCopy | None,
        reason: str,
        claim_id: str,
        holder: str | None,
        error: BaseException | None,
    ) -> None:
        runtime = self.runtime
        settings = self.settings
        first = held is None
        if held is None:
            held = HeldCopy(
                request=request,
                owner=owner,
                reason=reason,
                qos=self.consumer.qos,
                delivery=Delivery.of(request.message) if settings.refresh_unacked else None,
            )
            # a held message keeps its prefetch slot: give the slot back, as Celery does for
            # ETA requests, so the rest of the queue keeps flowing
            held.qos.increment_eventually()
            runtime.hold(held)
        changed = held.reason != reason
        held.reason = reason
        if reason == "unavailable":
            held.delay_ms = (
                settings.unavailable_retry_ms
                if first or changed or held.delay_ms == 0
                else min(held.delay_ms * 2, settings.unavailable_retry_max_ms)
            )
        else:
            held.delay_ms = settings.held_recheck_ms
        recheck_s = held.delay_ms / 1000
        if first or changed:
            runtime.counters.incr("held_unavailable" if reason == "unavailable" else "held")
            if reason == "unavailable":
                logger.warning(
                    "Held %s[%s]: claim store unavailable (%s); not run, retrying in %.1f s",
                    request.name,
                    request.id,
                    error,
                    recheck_s,
                )
            else:
                logger.info(
                    "Held %s[%s]: claim %s is held by %s; kept unacked, re-checking every %.1f s",
                    request.name,
                    request.id,
                    claim_id,
                    holder,
                    recheck_s,
                )
            signals.task_held.send(
                sender=request.task,
                request=request,
                reason=reason,
                claim_id=claim_id,
                holder=holder,
                recheck_s=recheck_s,
            )
        else:
            runtime.counters.incr("rechecks")
        held.timer_entry = self.consumer.timer.call_after(
            recheck_s, self._recheck, (held,), priority=6
        )

    def _recheck(self, held: HeldCopy) -> None:
        if held not in self.runtime.held_copies():
            return  # dropped by a connection restart: the broker redelivers it
        self._admit(held.request, owner=held.owner, held=held)

    def _release_hold(self, held: HeldCopy | None) -> None:
        if held is not None and self.runtime.unhold(held):
            held.qos.decrement_eventually()

    # --- lease lost while waiting for a lane -----------------------------------------------

    def _waiting_lost(self, claim: ActiveClaim) -> None:
        """From the keeper: a message waiting for its lane lost its claim (any thread)."""
        hub = getattr(self.consumer, "hub", None)
        if hub is not None:
            hub.call_soon(self._readmit, claim)
        else:
            self.consumer.timer.call_after(0, self._readmit, (claim,), priority=6)

    def _readmit(self, claim: ActiveClaim) -> None:
        # another worker owns the task now: this copy is a duplicate, and goes through the
        # gate again as one (held until the owner finishes, or taken over if it dies)
        if self.lanes is None:
            return
        waiter = self.lanes.forget(claim)
        if waiter is None:
            return
        if waiter.held:
            self.consumer.qos.decrement_eventually()
        request = waiter.request
        with claim.lock:
            claim.finished = True  # nothing of the lost claim is recorded or released
        for name in _WRAPPED:
            # back to Celery's own callbacks; the next claim wraps them again
            request.__dict__.pop(name, None)
        request.request_dict.pop(REQUEST_KEY, None)
        self._admit(request, owner=new_owner(self.runtime.hostname), held=None)

    # --- connection restarts and shutdown ---------------------------------------------------

    def resume(self) -> None:
        """The consumer (re)started: use the event loop's pipe again."""
        self._stopping = False

    def drop_connection_state(self) -> None:
        """Forget what belongs to the closing connection (reentrant, no logging).

        Held copies cannot be acked on a new channel and the broker redelivers them, so their
        timers are cancelled and they are dropped. Claims of requests that never reached the
        pool (Celery drops its queued requests on close) are released, so the redelivered
        copies do not wait for a lease nobody will finish.
        """
        runtime = self.runtime
        self._stopping = True
        if self._pipe is not None:
            # completions already sent are accounted for before the state goes; the socket
            # is closed (a restarted consumer connects again on its first message)
            with contextlib.suppress(Exception):
                self._pipe.drain()
            self._pipe.close()
        if self.lanes is not None:
            # waiting messages never reached the pool: their claims are released below
            self.lanes.drop_all()
        for held in runtime.held_copies():
            if runtime.unhold(held) and held.timer_entry is not None:
                # stop must neither raise nor log (it may run while the worker shuts down)
                with contextlib.suppress(Exception):
                    self.consumer.timer.cancel(held.timer_entry)
        for claim in runtime.live_claims():
            claim.delivery = None
            if not claim.dispatched:
                with contextlib.suppress(Exception):
                    runtime.finish(claim, done=False, why="connection closed before it ran")


def _drop_stale(request: Any, claim: ActiveClaim, exc: BaseException | None) -> None:
    logger.warning(
        "Claim %s: stale copy of %s[%s] ended (%s); nothing stored, message acked",
        claim.claim_id,
        request.name,
        request.id,
        type(exc).__name__,
    )
    task_ready(request)
    with contextlib.suppress(Exception):
        request.acknowledge()


def _guard(finish: Callable[..., None], claim: ActiveClaim, *, done: bool, why: str) -> None:
    # a bug or an outage here must never break Celery's own callback (ack, result, events)
    try:
        finish(claim, done=done, why=why)
    except Exception:
        logger.exception("Claim %s: completion handling failed", claim.claim_id)


class Gate(bootsteps.StartStopStep):  # type: ignore[misc]  # celery is untyped
    """Consumer bootstep installing the :class:`ClaimGate` (written like Celery's ``Heart``)."""

    label = "Claim gate"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        runtime = getattr(getattr(c, "controller", None), "claims", None)
        self.gate: ClaimGate | None = None
        c.claim_gate = None
        if isinstance(runtime, ClaimsRuntime):
            # wrapped here, before the Tasks step builds the strategies that capture it
            self.gate = ClaimGate(c, runtime, c.on_task_request)
            c.on_task_request = self.gate
            c.claim_gate = self.gate
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        if self.gate is not None:
            self.gate.resume()

    def stop(self, c: Any) -> None:
        if self.gate is not None:
            self.gate.drop_connection_state()

    shutdown = stop
