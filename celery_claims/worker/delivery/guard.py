"""The claim in task code, and the guard around every claimed task's body.

The gate puts a :class:`~celery_claims.fencing.TaskClaim` under ``"claim"`` in the request
dict it hands to the pool. That dict is what crosses to a prefork child (pickled with the
body), and Celery's tracer builds ``self.request`` (a ``Context``) from it in every pool, so
``self.request.claim`` works the same in prefork children, threads and solo.

Every claimed task's ``run`` is wrapped once, at worker start (before the pool forks), and the
wrapper runs in the process that runs the body:

- before the body, if the lease handed to the pool may have run out (the time is past its
  ``expires_at`` minus a margin for clock skew), it renews the claim, one round trip: a copy
  another copy owns raises :class:`StaleCopy` and never starts; a claim granted by a takeover
  under ``claims_max_takeovers`` has its start marked instead (one round trip, which checks
  the claim too), so the holder counts toward the limit if it dies after this point;
- after the body returns, it records the completion (one round trip, which checks the claim
  too) before the tracer stores the result and sends chain callbacks, so a result backend
  failure after the body can never make the attempt run again, and a stale copy (another
  copy owns the task) raises :class:`StaleCopy` instead of storing its result. When
  nothing can fail after the body (no result to store, no callback, chord or
  ``on_success`` of the task's own, ``acks_late``) and the claim store is the Redis
  broker's own server, the worker asks (``SETTLE_KEY``) for the record to be written with
  the removal of the delivery from kombu's unacked set, in one script, waited for here: the
  worker's ack then only forgets the delivery (``Lifecycle.pool_settle``). With a store
  apart, a prefork pool process (or a pool thread) records it as above and the worker acks
  without a write of its own; only where the worker writes the record itself before its ack
  (``ack_records``: the body runs on the event loop's thread, or the broker's keys are
  prefixed) and the lease handed to the pool cannot have run out does a prefork pool
  process send the record without waiting for its reply. Either way a main process paused
  or killed before its ack cannot let the task run again;
- a **canvas part** (a group member, or a copy with a chain's next step, callbacks or a
  chord to report: what a canvas waits on) is recorded after Celery's trace instead: after
  the body, the same check as before it (a stale copy sends nothing); the trace sends the
  next steps, stores the result and reports the part; then, at ``task_postrun``, a prefork
  pool process records the completion and waits for it, and the worker records it again
  before its ack (the record counts once). A worker killed between the body and the record
  lets the part run again, as a crash in its body would (its effects guarded as any
  body's), and never leaves a canvas waiting on a part recorded done but never reported;
  the steps the trace sends are of the part's run (``publish/runs.py``,
  :func:`~celery_claims.worker.publish.runs.inherit`), so those a part run again sends are
  turned away;
- after the body raised, the same check as before the body.

A store that does not answer is waited for (bounded by ``claims_start_timeout_ms``), then
:class:`ClaimUnverified` is raised: fail closed, never run or store unverified. Both are
``Ignore`` subclasses: Celery stores nothing and sends no callback; the worker's lifecycle
decides what happens to the message.
"""

from __future__ import annotations

import enum
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery import current_task, states
from celery.app.task import Context, Task
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import task_postrun
from celery.utils.log import get_logger

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.errors import BackendUnavailable, ClaimError, ClaimTokenError
from celery_claims.fencing import TaskClaim
from celery_claims.runs import owner_run
from celery_claims.worker.compat import request_fields
from celery_claims.worker.delivery.verdict import Verdict, record_done, recover
from celery_claims.worker.policy import is_exempt
from celery_claims.worker.publish import runs
from celery_claims.worker.settings import ClaimsSettings
from celery_claims.worker.transport.sender import ScriptCaller, ScriptSender, keep_calls, usable
from celery_claims.worker.transport.store import new_manager

__all__ = [
    "REQUEST_KEY",
    "SETTLE_KEY",
    "ClaimUnverified",
    "StaleCopy",
    "current_claim",
    "declare_request_key",
    "guard_tasks",
    "is_guarded",
    "nothing_after_body",
    "records_after_trace",
    "records_left_to_worker",
]

logger = get_logger("celery_claims.worker")

#: Key of the claim in the request dict handed to the pool (``self.request.claim``).
REQUEST_KEY = "claim"

#: Key, in the request dict handed to the pool, of what the process running the body needs to
#: settle the copy itself (kombu's unacked index and unacked keys, the delivery tag), where
#: the worker asks it to (``Lifecycle.pool_settle``).
SETTLE_KEY = "claims_settle"

#: Attribute marking a task whose ``run`` is already wrapped.
_GUARDED = "_celery_claims_guarded"

#: The ``task_postrun`` receiver of :func:`guard_tasks`, connected once a process.
_POSTRUN_UID = "celery_claims.guard.record_after_trace"


class StaleCopy(Ignore):  # type: ignore[misc]  # celery is untyped
    """Raised in place of a stale copy's outcome: its claim was taken over by another copy.

    An ``Ignore``: Celery stores no result, sends no callback, and acks the message.
    """


def declare_request_key() -> None:
    """Make ``claim`` and ``claims_settle`` known fields of Celery's task ``Context``
    (idempotent).

    ``Context`` treats every request field it does not define as a custom message header and
    copies it into the messages a task sends with ``retry()`` or ``replace()``: the claim of
    one attempt would leak into the next (and fail to serialize), and so would the settle
    of its delivery (kombu's keys and its delivery tag). Declaring the fields (default
    ``None``) keeps them out of the headers, and makes ``self.request.claim`` read ``None``
    in a task that is not claimed instead of raising ``AttributeError``.
    """
    for key in (REQUEST_KEY, SETTLE_KEY):
        if key not in Context.__dict__:
            setattr(Context, key, None)


def current_claim() -> TaskClaim | None:
    """The claim of the task running in this thread, or None (not claimed, not in a task).

    Works in every pool, prefork children included; same as ``self.request.claim`` in a
    bound task.
    """
    task = current_task
    if task is None:
        return None
    claim = getattr(task.request, REQUEST_KEY, None)
    return claim if isinstance(claim, TaskClaim) else None


class ClaimUnverified(Ignore):  # type: ignore[misc]  # celery is untyped
    """Raised when the pool process cannot reach the claim store to check its claim.

    Fail closed: a copy that cannot be verified does not start, and a body that ended while
    the store was unreachable stores no result. An ``Ignore``, so Celery stores nothing; the
    worker's main process decides what happens to the message from :attr:`phase`:

    - ``"start"``: the body never ran; the message goes back to the broker;
    - ``"failed"``: the body raised; the message goes back to the broker (it runs again);
    - ``"done"``: the body returned; the main process records the completion once the store
      answers, and only then acknowledges the message;
    - ``"unreported"``: a canvas part's body returned, but nothing was sent or reported for
      it; the message goes back to the broker (it runs again).
    """

    def __init__(self, message: str = "", phase: str = "start") -> None:
        # both in args: exceptions cross from a prefork child to the parent by pickling
        super().__init__(message, phase)

    @property
    def phase(self) -> str:
        """``"start"``, ``"failed"`` or ``"done"``: how far the copy got."""
        return str(self.args[1]) if len(self.args) > 1 else "start"


_T = TypeVar("_T")


class Settled(enum.Enum):
    """How far a pool process got settling a copy itself (:meth:`_Verifier.settle`)."""

    #: the completion is recorded and the delivery removed
    SETTLED = "settled"
    #: the completion was recorded already (by this owner, under another instance), the
    #: delivery is still there
    RECORDED = "recorded"
    #: another copy owns or finished the task: nothing written, the delivery left alone
    LOST = "lost"


class _Verifier:
    """Checks, from the process running the task, that its claim is still its own."""

    def __init__(
        self, settings: ClaimsSettings, manager: RedisClaimManager, *, ack_records: bool
    ) -> None:
        self.settings = settings
        self.ack_records = ack_records
        self.parent_pid = os.getpid()
        self._parent_manager = manager
        self._manager: RedisClaimManager | None = None
        self._pid = -1
        # used in pool processes only, each with connections of its own
        self._sender = ScriptSender(_record_reply)
        self._caller = ScriptCaller()
        self._lock = threading.Lock()

    def manager(self) -> RedisClaimManager:
        pid = os.getpid()
        if pid == self.parent_pid:
            return self._parent_manager
        manager = self._manager
        if manager is not None and self._pid == pid:
            return manager  # every call of a pool process after its first
        with self._lock:
            if self._manager is None or self._pid != pid:
                # a prefork child: never share the parent's sockets across fork
                manager = new_manager(self.settings)
                # its calls on a connection kept for them: a third of the CPU of the
                # client's (docs/benchmarks.md), which a no-op task's settle pays
                keep_calls(manager, self._caller)
                self._manager, self._pid = manager, pid
            return self._manager

    def still_mine(self, claim: TaskClaim) -> bool:
        """False if another copy owns the task now.

        Raises:
            BackendUnavailable: the store could not be asked (the caller fails closed).
        """
        if _surely_held(claim):
            return True

        def ask() -> bool:
            manager = self.manager()
            result = manager.renew(claim.queue_id, [claim.token()], claim.lease_ms)
            if not result or not isinstance(result[0], ClaimTokenError):
                return True
            return recover(manager, claim.token(), result[0], claim.lease_ms).verdict is (
                Verdict.OURS
            )

        return self._answered(ask)

    def leaves_record_to_ack(self, task: Any, request: Any, claim: TaskClaim) -> bool:
        """True if the worker's ack will write this attempt's record (module docstring);
        ``request``: the task's ``self.request``, not a canvas part's (its caller checked)."""
        return (
            self.ack_records
            and _surely_held(claim)
            and _quiet_after_body(task, getattr(request, "ignore_result", False))
        )

    def send_record(self, claim: TaskClaim) -> None:
        """Write the attempt's record from a prefork pool process without waiting for it.

        The worker's ack writes the record too (and removes the delivery), but only once the
        main process gets the result: a main process paused or killed after the body
        returned would let the lease run out and the task run again. Sent here, before the
        result leaves the pool process, the record is on its way whatever happens to the main
        process after that. Best effort: where it cannot be sent, the ack records it.
        """
        if os.getpid() == self.parent_pid:
            return  # solo and threads pools: the body and the ack share one process
        manager = self.manager()
        try:
            call = manager.complete_call(claim.token(), self.settings.done_ttl_ms)
        except ClaimError:
            return
        if not usable(manager.client):
            return  # Sentinel, Cluster: the ack records it
        try:
            self._sender.send(manager.client, call)
        except ClaimError as exc:
            logger.debug("completion record not sent ahead of the ack: %s", exc)

    def settle(self, claim: TaskClaim, keys: tuple[str, str], tag: str) -> Settled:
        """Record the attempt's completion and remove its delivery from kombu's unacked set,
        in one script (``ack_done.lua``), and wait for it: the worker's ack then has nothing
        left to write (``Lifecycle.pool_settle``).

        Returns:
            how far it got (:class:`Settled`).

        Raises:
            BackendUnavailable: the store did not answer within ``claims_start_timeout_ms``.
        """
        ttl = self.settings.done_ttl_ms

        def ask() -> Settled:
            manager = self.manager()
            token = claim  # a TaskClaim is a ClaimToken: the same fields, not one more copy
            try:
                manager.execute(manager.ack_done_call(token, ttl, keys, tag))
                return Settled.SETTLED
            except ClaimTokenError as exc:
                found = recover(manager, token, exc, claim.lease_ms)
            if found.verdict is Verdict.OURS:
                # the store had lost the claim, or this worker re-claimed it: under the
                # current token
                assert found.token is not None
                manager.execute(manager.ack_done_call(found.token, ttl, keys, tag))
                return Settled.SETTLED
            if found.verdict is Verdict.RECORDED:
                return Settled.RECORDED
            return Settled.LOST

        return self._answered(ask)

    def mark_started(self, claim: TaskClaim) -> None:
        """Mark the claim's start in the store (see ``ClaimManager.mark_started``), and wait
        for the store to take it: one round trip, for taken-over claims only.

        Waited for, not sent ahead: a mark the store never took (it was down, restarting,
        ``LOADING``) would leave a poison task's holder uncounted, and the task would run
        once more than the takeover limit allows (a soak run saw it: 6 runs under a limit
        of 4). The mark also checks the claim, so it stands in for the start check.

        Raises:
            ClaimTokenError: another copy owns the task now (the caller does not start it).
            BackendUnavailable: the store did not answer within ``claims_start_timeout_ms``
                (the caller fails closed).
        """
        token = claim.token()

        def mark() -> None:
            manager = self.manager()
            try:
                manager.mark_started(token)
            except ClaimTokenError as exc:
                # as the start check: a claim the store lost (a restart) may be re-claimed
                if recover(manager, token, exc, claim.lease_ms).verdict is not Verdict.OURS:
                    raise

        self._answered(mark)

    def record_done(self, claim: TaskClaim) -> Verdict:
        """Record the completion of the attempt (see :func:`~.recovery.record_done`).

        Raises:
            BackendUnavailable: the store did not answer within ``claims_start_timeout_ms``.
        """
        return self._answered(
            lambda: (
                record_done(
                    self.manager(),
                    claim,  # a ClaimToken (as in settle)
                    lease_ms=claim.lease_ms,
                    done_ttl_ms=self.settings.done_ttl_ms,
                ).verdict
            )
        )

    def _answered(self, ask: Callable[[], _T]) -> _T:
        """``ask()``, retried while the store is unreachable, for a bounded time.

        Waiting costs the worker nothing: while its claim store is unreachable no other copy
        can start on it either. A store that stays away longer than
        ``claims_start_timeout_ms`` ends the wait with :class:`BackendUnavailable`.
        """
        started = time.monotonic()
        deadline: float | None = None
        delay_s = 0.0
        while True:
            try:
                return ask()
            except BackendUnavailable:
                if deadline is None:  # the wait's terms, worked out where there is a wait
                    deadline = started + self.settings.start_timeout_ms / 1000
                    delay_s = self.settings.unavailable_retry_ms / 1000
                if time.monotonic() + delay_s >= deadline:
                    raise
                time.sleep(delay_s)
                delay_s = min(delay_s * 2, self.settings.unavailable_retry_max_ms / 1000)


def _record_reply(reply: Any, error: BaseException | None) -> None:
    """A record sent ahead of the ack that failed only means the worker's ack writes it."""
    if error is not None:
        logger.debug("a completion record sent ahead of the ack failed: %s", error)


def _surely_held(claim: TaskClaim) -> bool:
    """True if no other copy can have taken ``claim`` over yet.

    Nobody can take a claim over before its lease ends, and the lease handed to the pool ended
    no earlier than ``claim.expires_at`` (renewals only extend it). The margin covers clock
    skew between this host and the claim store's clock.
    """
    return time.time() * 1000 < claim.expires_at - claim.lease_ms // 4


def nothing_after_body(
    task: Any, *, callbacks: Any, chain: Any, chord: Any, group: Any, ignore_result: Any
) -> bool:
    """True if nothing Celery does after this task's body returns can fail the attempt.

    What can: storing the result (a result backend outage), anything of a canvas part
    (callbacks, a chain's next step, a chord's part, a group member's result: recorded after
    the trace), the task's own ``on_success``; and with early acks the message is gone
    already.
    The pool process (from its ``task.request``) and the worker (from the message's request
    dict, the same fields) answer alike: where this is True the pool process leaves the
    record to the worker, which writes it before the ack.
    """
    return not _is_canvas_part(callbacks, chain, chord, group) and _quiet_after_body(
        task, ignore_result
    )


def _quiet_after_body(task: Any, ignore_result: Any) -> bool:
    """:func:`nothing_after_body` for a copy that is no canvas part."""
    if not task.acks_late or type(task).on_success is not Task.on_success:
        return False
    return bool(task.ignore_result or ignore_result or isinstance(task.backend, DisabledBackend))


def records_left_to_worker(request: Any) -> bool:
    """True if the pool process that runs ``request`` (a worker ``Request``) leaves its
    completion record to the worker, when its lease cannot have run out (and may have, if
    it could: the worker then writes it again, which is harmless)."""
    fields = request_fields(request)
    get = fields.get
    if get("callbacks") or get("chain") or get("chord") or get("group"):
        return False  # a canvas part (_is_canvas_part, inline: asked for every message)
    return _quiet_after_body(request.task, fields.get("ignore_result", False))


def _is_canvas_part(callbacks: Any, chain: Any, chord: Any, group: Any) -> bool:
    """True for a copy after whose body Celery's trace sends, stores or reports something a
    canvas waits on: callbacks, a chain's next step, a chord's part, a group member's result
    (module docstring)."""
    return bool(callbacks or chain or chord or group)


def records_after_trace(request: Any) -> bool:
    """True if the process that runs ``request`` (a worker ``Request``) records its completion
    after Celery's trace, not when its body returns: a canvas part (module docstring). The
    worker then writes the record itself before its ack."""
    fields = request_fields(request)
    return _is_canvas_part(
        fields.get("callbacks"), fields.get("chain"), fields.get("chord"), fields.get("group")
    )


def _guarded_run(run: Any, task: Any, verifier: _Verifier) -> Any:
    @functools.wraps(run)
    def claims_guarded_run(*args: Any, **kwargs: Any) -> Any:
        # the request of this call (``task.request`` is a property over a thread's stack)
        request = task.request
        claim = getattr(request, REQUEST_KEY, None)
        if not isinstance(claim, TaskClaim):
            return run(*args, **kwargs)
        if claim.mark_start:
            _mark_start(task, claim, verifier)
        elif not _surely_held(claim):  # else nobody can have taken it over: no question
            _check(task, claim, verifier, "start", "before it started")
        try:
            retval = run(*args, **kwargs)
        except (Ignore, Reject, Retry):
            raise
        except Exception as exc:
            _check(task, claim, verifier, "failed", f"failed ({type(exc).__name__})", exc)
            raise
        if request.callbacks or request.chain or request.chord or request.group:
            # a canvas part (_is_canvas_part, inline: asked for every body): recorded after
            # the trace has sent and reported what other tasks wait on, which are of this
            # copy's run (both at task_postrun)
            _check(task, claim, verifier, "unreported", "finished")
            runs.inherit(owner_run(claim.owner))
            _after_trace.pending = (request.id, claim, verifier)
            return retval
        # The completion is recorded here, before the tracer stores the result: whatever
        # happens to the result (a result backend outage fails the task after its body
        # returned), a later copy of this attempt is acknowledged without running.
        settle = getattr(request, SETTLE_KEY, None)
        if settle is not None:
            _settle(task, claim, verifier, settle)
            return retval
        if verifier.leaves_record_to_ack(task, request, claim):
            verifier.send_record(claim)
            return retval
        try:
            verdict = verifier.record_done(claim)
        except ClaimError as exc:
            raise _unverified(task, claim, "done", exc) from exc
        if verdict is Verdict.LOST:
            raise _stale(task, claim, "finished")
        return retval

    setattr(claims_guarded_run, _GUARDED, True)
    return claims_guarded_run


#: per thread: the canvas part whose completion is recorded when its trace ends, as
#: ``(task id, claim, verifier)``
_after_trace = threading.local()


def _record_after_trace(task_id: Any = None, state: Any = None, **_: Any) -> None:
    """``task_postrun``: record a canvas part's completion after Celery's trace (module
    docstring), in a prefork pool process, and wait for it; the worker records it again."""
    runs.end_inherit()
    pending = getattr(_after_trace, "pending", None)
    _after_trace.pending = None
    if pending is None or pending[0] != task_id or state != states.SUCCESS:
        return  # not a canvas part, or Celery failed it after its body (not a success)
    _, claim, verifier = pending
    if os.getpid() == verifier.parent_pid:
        return  # solo and threads pools: the worker records it, in this very process
    try:
        verdict = verifier.record_done(claim)
    except ClaimError as exc:
        logger.info("claim %s: completion left to the worker: %s", claim.task_id, exc)
        return
    if verdict is Verdict.LOST:
        logger.warning(
            "claim %s/%s (instance %d) was taken over as its trace ended",
            claim.queue_id,
            claim.task_id,
            claim.instance,
        )


def _check(
    task: Any,
    claim: TaskClaim,
    verifier: _Verifier,
    phase: str,
    what: str,
    cause: BaseException | None = None,
) -> None:
    try:
        mine = verifier.still_mine(claim)
    except ClaimError as exc:
        raise _unverified(task, claim, phase, exc) from cause or exc
    if not mine:
        raise _stale(task, claim, what) from cause


def _settle(task: Any, claim: TaskClaim, verifier: _Verifier, settle: Any) -> None:
    """Record the completion and remove the delivery (``SETTLE_KEY``); a success reported
    after this means both are done, any other outcome is raised for the worker to handle."""
    index_key, unacked_key, tag = settle
    try:
        outcome = verifier.settle(claim, (index_key, unacked_key), tag)
    except ClaimError as exc:
        raise _unverified(task, claim, "done", exc) from exc
    if outcome is Settled.LOST:
        raise _stale(task, claim, "finished")
    if outcome is Settled.RECORDED:
        # the delivery is still there: the worker acks it once it has checked the record
        # itself (as for a completion it could not verify)
        logger.info(
            "%s[%s]: completion of claim %s/%s found recorded already; ack left to the worker",
            task.name,
            task.request.id,
            claim.queue_id,
            claim.task_id,
        )
        raise ClaimUnverified(f"claim instance {claim.instance}: ack left to the worker", "done")


def _mark_start(task: Any, claim: TaskClaim, verifier: _Verifier) -> None:
    """The start check of a taken-over claim: its start marked in the store (fail closed)."""
    try:
        verifier.mark_started(claim)
    except ClaimTokenError as exc:
        raise _stale(task, claim, "before it started") from exc
    except ClaimError as exc:
        raise _unverified(task, claim, "start", exc) from exc


def is_guarded(task: Any) -> bool:
    """True if ``task``'s run records its own completion (wrapped by :func:`guard_tasks`)."""
    return bool(getattr(getattr(task, "run", None), _GUARDED, False))


def _unverified(task: Any, claim: TaskClaim, phase: str, error: BaseException) -> ClaimUnverified:
    logger.warning(
        "%s[%s]: claim %s/%s (instance %d) cannot be verified at %s (%s); failing closed",
        task.name,
        task.request.id,
        claim.queue_id,
        claim.task_id,
        claim.instance,
        phase,
        error,
    )
    return ClaimUnverified(f"claim instance {claim.instance} could not be verified", phase)


def _stale(task: Any, claim: TaskClaim, what: str) -> StaleCopy:
    logger.warning(
        "%s[%s] %s after its claim %s/%s (instance %d) was taken over: result discarded",
        task.name,
        task.request.id,
        what,
        claim.queue_id,
        claim.task_id,
        claim.instance,
    )
    return StaleCopy(f"claim instance {claim.instance} was taken over")


def guard_tasks(
    app: Any, settings: ClaimsSettings, manager: RedisClaimManager, *, ack_records: bool = False
) -> int:
    """Wrap the ``run`` of every claimed task of ``app`` (idempotent); returns how many.

    Called when the worker starts, before the pool forks and before the consumer builds the
    tracers (which capture ``task.run``). ``ack_records``: the worker writes the completion
    record of a task after whose body nothing can fail before it acks the message (in the
    ack's own script where the claim store is the Redis broker's server, on the consumer's
    pipe elsewhere), so a pool process may leave it to the worker
    (:func:`records_left_to_worker`).
    """
    verifier = _Verifier(settings, manager, ack_records=ack_records)
    # connected before any tracer is built, not when it is first needed: Celery's tracer keeps
    # the signal's list of receivers (build_tracer), and Signal.connect replaces that list
    # where a weakly connected receiver died, so a later connect may never reach it
    task_postrun.connect(_record_after_trace, weak=False, dispatch_uid=_POSTRUN_UID)
    wrapped = 0
    for name, task in list(app.tasks.items()):
        if is_exempt(task, name) or getattr(task.run, _GUARDED, False):
            continue
        # an instance attribute: the tracer and Task.__call__ both look run up on the task
        task.run = _guarded_run(task.run, task, verifier)
        wrapped += 1
    return wrapped
