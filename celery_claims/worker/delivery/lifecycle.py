"""The lifecycle of a delivered copy: the one door through which every copy moves and ends.

Every message the claim gate sees becomes a :class:`Copy` with a :class:`State`. The legal
moves are :data:`.state.TRANSITIONS` (and docs/semantics.md, "The lifecycle of a delivered copy");
:class:`Lifecycle` makes them, each under one lock, and is the only place that acks, rejects,
forgets a delivery or releases a claim. Every rule that keeps a task from being lost or run
twice is a transition here:

- a message is acked only when its task is recorded done (``SKIPPED``, ``DONE``), or when
  Celery's own handler ends an attempt that ran (``RELEASED``: failures keep Celery's rules);
- a stale copy (another copy owns the task now) never acks on the Redis broker, where it
  shares its delivery tag, and so its record in ``unacked``, with the live owner's copy: it is
  forgotten in this worker only (``STALE`` -> ``GONE``). On other brokers its own delivery is
  acked when another copy owns a live lease, and handed back otherwise;
- a copy that cannot be verified never starts: its message is handed back to the broker;
- a copy the pool does not start in time is given up: its claim released, its message handed
  back, so another worker runs it;
- Celery's ``task_ready`` always runs for a copy that reached the pool, whatever the store says.

The parts, each in a file of its own, lowest first: :mod:`.registry` (the copies and the one
place their state changes), :mod:`.wiring` (what the parts share), :mod:`.turns` (the pool
hand-off; taken-over copies one at a time), :mod:`.holds` (held copies and their re-checks),
:mod:`.unrun` (acks without running), :mod:`.endings` (released, let go, handed back),
:mod:`.losses` (a lease lost to another copy, a copy never started), :mod:`.completion` (the
record, then the ack). :class:`Lifecycle` wires them and takes every event from the gate, the
pool and the keeper.

Threads: the gate, timers and pool callbacks of prefork and solo call in from the consumer's
event loop, the thread pool's callbacks from its threads, the lease keeper from its own. Store
calls are made outside the lock; broker calls are made on the consumer's thread
(``consumer.call_soon``) unless the caller is on it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from celery.exceptions import Ignore, Reject, Retry
from celery.utils.log import get_logger

from celery_claims.claims.redis import RedisClaimManager
from celery_claims.errors import ClaimError, ClaimTokenError
from celery_claims.model import ClaimToken, Success, TookOver
from celery_claims.rates import RateResult
from celery_claims.worker import signals
from celery_claims.worker.compat import prefetch_qos, task_ready
from celery_claims.worker.delivery.ack_on_claim import AckOnClaim
from celery_claims.worker.delivery.completion import Completion
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.endings import Endings
from celery_claims.worker.delivery.guard import ClaimUnverified, StaleCopy
from celery_claims.worker.delivery.holds import Holds
from celery_claims.worker.delivery.keyed import KeyedClaim
from celery_claims.worker.delivery.lane_model import Lane, LaneSlot
from celery_claims.worker.delivery.lanes import WorkerLanes
from celery_claims.worker.delivery.losses import Losses
from celery_claims.worker.delivery.rates import WorkerRates
from celery_claims.worker.delivery.registry import Registry
from celery_claims.worker.delivery.state import RENEWED, IllegalMove, State
from celery_claims.worker.delivery.turns import Turns
from celery_claims.worker.delivery.unrun import Unrun
from celery_claims.worker.delivery.valve import QueueValve
from celery_claims.worker.delivery.verdict import Recovery, Verdict, recover
from celery_claims.worker.delivery.wiring import Wiring
from celery_claims.worker.settings import ClaimsSettings
from celery_claims.worker.signals import Counters
from celery_claims.worker.transport.broker import Delivery

__all__ = ["Lifecycle"]

logger = get_logger("celery_claims.worker")

#: Exceptions that end an attempt with a successor message (or none needed): record done.
#: ``Retry`` has published the next attempt; ``Ignore`` is what ``Task.replace`` raises after
#: publishing the replacement (and a task raising it asks for no re-run).
_DONE_EXCEPTIONS = (Retry, Ignore)

#: The one state a copy starts from (:meth:`Lifecycle.started`; made once, not per message).
_QUEUED = frozenset({State.QUEUED})


class _Wired:
    """An attribute of the lifecycle kept in its :class:`Wiring`, shared by every part."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return getattr(obj.w, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.w, self.name, value)


class Lifecycle:
    """Every delivered copy of one worker: the events of the gate, the pool and the keeper.

    Args:
        settings: the worker's settings.
        manager: the claim manager (blocking client).
        counters: the worker's counters.
        lanes: the worker's lanes, if any.
        hostname: the worker's node name (for new owner strings).

    Attributes:
        ride_acks: the claim store is the Redis broker's own server: a succeeded guarded copy's
            completion is written by its ack, in one script (:meth:`succeeded`), and its pool
            process may leave the record to that ack (``guard.py``).
        records_left: pool processes leave the completion record of a task after whose body
            nothing can fail to the worker (``guard_tasks(ack_records=True)``), which writes
            it before the ack: on the consumer's pipe, without holding up the event loop,
            where the store is not the broker (:meth:`succeeded`).
        pool: the worker's pool, to terminate a stale copy's process.
        on_gone: told ``(queue_id, task_key, done)`` when a copy's message is gone from the
            broker for good (its publish journal entry can go).
        wake_keeper: wakes the lease keeper (set by it).
    """

    settings = _Wired()
    manager = _Wired()
    counters = _Wired()
    lanes = _Wired()
    slots = _Wired()
    waker = _Wired()
    recent = _Wired()
    pool = _Wired()
    ride_acks = _Wired()
    records_left = _Wired()
    on_gone = _Wired()
    wake_keeper = _Wired()

    def __init__(
        self,
        settings: ClaimsSettings,
        manager: RedisClaimManager,
        counters: Counters,
        lanes: WorkerLanes | None,
        hostname: str,
    ) -> None:
        self.w = w = Wiring(settings, manager, counters, lanes, hostname)
        #: the copies and their states (the keeper's and the operator's reads)
        self.reg = reg = Registry()
        #: acknowledging once claimed (``claims_ack_on_claim``)
        self.acks = AckOnClaim(w)
        self.turns = Turns(w, reg, self.acks)
        #: the gate's outcomes that keep a copy, or end it, outside the pool
        self.holds = Holds(w, reg)
        self.unrun = Unrun(w, reg, self.holds)
        self.ends = Endings(w, reg, self.turns)
        #: the keeper's give-ups, and the copies whose lease another copy took
        self.losses = Losses(w, reg, self.turns, self.ends)
        #: the pool's successes, Celery's ack, and the keeper's retried records
        self.done = Completion(w, reg, self.ends, self.losses)
        #: copies waiting for their fleet-wide rates (claimed, before their lane)
        self.rates = WorkerRates(w, reg, self._past_rates)
        #: stops and starts taking a queue's messages for them
        self.valve = QueueValve(w)
        #: lease (ms) -> whether a claim of it is renewed more often than the keeper beats
        #: (it wakes the keeper): a few distinct leases, asked for every claim
        self._short_leases: dict[int, bool] = {}
        #: the waker and the slots are bound to the consumer's loop and QoS (:meth:`on_loop`;
        #: until its connection closes)
        self._loop_bound = False
        if lanes is not None:
            lanes.slots = w.slots
            lanes.waker = w.waker

    # --- wiring (consumer bootstep) ---------------------------------------------------------

    def bind(
        self,
        consumer: Any,
        dispatch: Callable[[Copy], None],
        recheck: Callable[[Copy], None],
        send: Callable[[Any, Callable[[Any], None]], bool] | None = None,
    ) -> None:
        """Attach the consumer (timer, QoS, ``call_soon``), the gate's pool hand-off and its
        pipe (``send``)."""
        self.w.consumer = consumer
        self.w.dispatch = dispatch
        self.w.recheck = recheck
        if send is not None:
            self.w.send = send
        if self.w.lanes is not None:
            self.w.lanes.bind(consumer, self.lane_granted)

    def loop_started(self) -> None:
        """The consumer (re)started, on its loop's thread: the loop can be woken again."""
        self._loop_bound = False  # its hub and QoS are bound again at the next message
        self.w.waker.attach(self.w.consumer)
        self.rates.resume()

    def on_loop(self) -> int:
        """The caller is the consumer's event loop (the gate calls this for each message);
        returns the loop's thread's ident."""
        self.w.loop_thread = ident = threading.get_ident()
        if self._loop_bound:
            return ident  # bound since the consumer (re)started: nothing changed since
        self.w.waker.attach(self.w.consumer)
        qos, window = prefetch_qos(self.w.consumer)
        if self.w.slots.qos is not qos:
            self.w.slots.bind(qos, window, self.valve)
        self._loop_bound = True
        return ident

    # --- the gate's outcomes ----------------------------------------------------------------

    def receive(
        self,
        request: Any,
        *,
        owner: str,
        queue_id: str,
        task_key: str,
        lease_ms: int,
        guarded: bool,
        key: KeyedClaim | None = None,
        lane_key: str = "",
        run: int | None = None,
    ) -> Copy:
        """A new copy in the gate (``RECEIVED``); ``key``: its keyed claim, if any;
        ``lane_key``: its key in a keyed lane, if it is in one; ``run``: the canvas run its
        owner names."""
        refresh = self.w.settings.refresh_unacked
        copy = Copy(
            request=request,
            owner=owner,
            queue_id=queue_id,
            task_key=task_key,
            lease_ms=lease_ms,
            guarded=guarded,
            delivery=Delivery.of(request.message) if refresh else None,
            key=key,
            lane_key=lane_key,
            run=run,
        )
        self.reg.add(copy)
        return copy

    def acquired(
        self,
        copy: Copy,
        result: Success | TookOver,
        lane: Lane | None,
        rate: RateResult | None = None,
    ) -> None:
        """The claim was granted: to the lane (``WAITING``) or the pool (``QUEUED``).

        ``rate``: the verdict of the copy's rates, when its claim's call asked them.
        """
        assert result.token is not None
        took_over = isinstance(result, TookOver)
        copy.token = result.token
        # a keyed claim is claimed without a takeover limit (gate.py): nothing to mark
        copy.mark_start = (
            took_over and self.w.settings.max_takeovers is not None and copy.key is None
        )
        copy.renew_sent_at = time.monotonic()
        short = self._short_leases.get(copy.lease_ms)
        if short is None:
            settings = self.w.settings
            short = settings.renew_interval_for(copy.lease_ms) < settings.renew_interval_ms
            self._short_leases[copy.lease_ms] = short
        if short:
            self.w.wake_keeper()
        if copy.timer_entry is not None:  # a held copy's re-check
            self.holds.cancel_timer(copy)
        self.w.slots.take_back(copy)
        self.w.counters.incr("took_over" if took_over else "acquired")
        _announce_claim(copy, result)
        if copy.rate_limits or (lane is not None and self.w.lanes is not None):
            # it waits outside the pool, its prefetch slot given back: acked now (when asked),
            # for a wait may outlast the broker's timeout; a copy going to the pool is acked
            # when the pool starts it (started), so Celery's prefetch still bounds what waits
            # in the pool
            self.acks.take(copy)
        if copy.rate_limits:
            # its rates first: a copy waiting for its turn to start holds no lane slot
            self.reg.move(copy, State.WAITING)
            self.rates.admit(copy, copy.rate_limits, lane, rate)
        elif lane is None:
            self.turns.in_turn(copy)  # no rate, no lane (the common case): to its turn
        else:
            self._past_rates(copy, lane)

    def _past_rates(self, copy: Copy, lane: Lane | None) -> None:
        """A claimed copy its rates (if any) let start: to its lane or the pool."""
        if lane is not None and self.w.lanes is not None:
            if copy.state is not State.WAITING:
                self.reg.move(copy, State.WAITING)
            self.w.lanes.admit(lane, copy)
        else:
            self.turns.in_turn(copy)

    def lane_granted(self, copy: Copy, slot: LaneSlot) -> None:
        """A lane slot for a waiting copy (event loop): to the pool."""
        if copy.state is not State.WAITING:
            if self.w.lanes is not None:
                self.w.lanes.release(slot)
            return
        copy.lane_slot = slot
        self.w.slots.take_back(copy)
        self.turns.in_turn(copy)

    # --- the pool's callbacks ---------------------------------------------------------------

    def started(self, copy: Copy) -> None:
        """The pool started the copy (``on_accepted``): ``QUEUED`` -> ``RUNNING``."""
        if copy.time_limit_s is not None:
            copy.renew_until = time.monotonic() + copy.time_limit_s
        if self.reg.move(copy, State.RUNNING, only_from=_QUEUED):
            self.acks.take(copy)
        if copy.mark_start and not copy.guarded and copy.token is not None:
            self.mark_started(copy.token)

    def mark_started(self, token: ClaimToken) -> None:
        """Mark an unguarded copy's start (its pool process cannot): best effort, as in
        ``guard.py``, on the consumer's pipe where it can go there."""
        try:
            call = self.w.manager.mark_started_call(token)
            if not self.w.send(call, lambda outcome: None):
                self.w.manager.execute(call)
        except ClaimError as exc:
            logger.debug("Claim %s/%s: start not marked: %s", token.queue_id, token.task_id, exc)

    def failed(
        self, copy: Copy, exc: BaseException | None, celery_handler: Callable[[], object]
    ) -> None:
        """The attempt ended without a success (``on_failure``; ``exc`` unwrapped)."""
        state = copy.state
        if state is State.STALE or isinstance(exc, StaleCopy):
            if isinstance(exc, StaleCopy):
                self.w.counters.incr("fenced_success")  # its guard discarded the outcome
            if state in (State.QUEUED, State.RUNNING):
                self.ends.go_stale(
                    copy, f"stale copy ended ({type(exc).__name__})", other_owner=True
                )
            self.ends.let_go(copy, f"ended ({type(exc).__name__}) after it went stale")
            return
        if state not in (State.QUEUED, State.RUNNING):
            self.ends.report_again(copy, celery_handler)
            return
        if isinstance(exc, ClaimUnverified):
            if exc.phase == "done":
                # the body returned: the record is written once the store answers, and the
                # message is acked only then (it may share its record with a live owner)
                task_ready(copy.request)
                copy.deferred_ack = copy.request.acknowledge
                self.ends.leave_pool(copy, State.COMPLETING, "body returned, claim unverifiable")
                self.w.counters.incr("completion_deferred")
                self.done.unwritten_now(copy)
                return
            self.ends.hand_back(copy, f"claim unverifiable ({exc.phase})")
            return
        if isinstance(exc, _DONE_EXCEPTIONS):
            self.done.record(copy, type(exc).__name__.lower(), celery_handler)
            return
        why = "rejected" if isinstance(exc, Reject) else f"failed ({type(exc).__name__})"
        self.ends.release(copy, why)
        # a message acked at claim cannot be requeued: its journal entry, kept, is published
        # again by recovery instead
        requeue = isinstance(exc, Reject) and bool(getattr(exc, "requeue", False))
        self.ends.end_by_celery(copy, celery_handler, requeue=requeue)

    def timed_out(self, copy: Copy, soft: bool, celery_handler: Callable[[], object]) -> None:
        """A time limit fired (``on_timeout``); a hard one releases the claim."""
        if soft:
            celery_handler()
            return
        if copy.state in (State.QUEUED, State.RUNNING):
            self.ends.release(copy, "hard time limit")
        if copy.state is State.RELEASED:
            self.ends.end_by_celery(copy, celery_handler)
        else:
            self.ends.report_again(copy, celery_handler)

    def revoked(self, copy: Copy) -> None:
        """Revoked before it ran: Celery acks it without a callback; release the claim."""
        if copy.state in (State.QUEUED, State.RUNNING):
            self.w.counters.incr("revoked_released")
            self.ends.release(copy, "revoked")

    def time_limit_passed(self, copy: Copy) -> None:
        """A running copy passed its time limit: its claim is no longer renewed.

        The prefork pool stops such a task itself (hard limit); the threads, solo and eventlet
        pools never do, and gevent only when the task yields. A hung task must not hold its
        claim for ever, so its lease runs out and (with the Redis broker, once
        ``visibility_timeout`` has passed without a refresh) its message comes back and is
        taken over. The copy is not stopped; if it ends after another copy took over, its
        outcome is discarded (it is found stale when its completion is written).
        """
        if copy.overran:
            return
        copy.overran = True
        self.w.counters.incr("time_limit_overruns")
        logger.warning(
            "Claim %s: %s[%s] has run past its time limit (%g s), which this pool did not "
            "enforce; its claim is no longer renewed: it expires within claims_lease_ms and "
            "another copy takes the task over",
            copy.claim_id,
            copy.request.name,
            copy.request.id,
            copy.time_limit_s,
        )

    # --- the keeper's findings (keeper thread) ----------------------------------------------

    def renewal(self, copy: Copy, outcome: ClaimToken | ClaimTokenError) -> None:
        """Apply one renewal's outcome: the new token, or a refused one to resolve."""
        if isinstance(outcome, ClaimToken):
            copy.token = outcome
            self.w.counters.incr("renewals")
            return
        with self.reg.lock:
            if copy.state not in RENEWED or copy.recorded:
                return  # it ended (or recorded) between the snapshot and the renewal
        try:
            assert copy.token is not None
            found = recover(self.w.manager, copy.token, outcome, copy.lease_ms)
        except ClaimError as exc:
            logger.warning("Claim %s: renewal refused, cannot resolve now: %s", copy.claim_id, exc)
            return
        self._resolved(copy, found)

    def _resolved(self, copy: Copy, found: Recovery) -> None:
        if found.verdict is Verdict.OURS:
            assert found.token is not None
            copy.token = found.token
            if found.reclaimed:
                self.w.counters.incr("reclaimed")
                logger.warning(
                    "Claim %s: the claim store had lost it (restart or failover); claimed it "
                    "again (instance %d)",
                    copy.claim_id,
                    copy.instance,
                )
            if copy.state is State.COMPLETING:
                self.done.complete_deferred(copy)
            return
        if found.verdict is Verdict.RECORDED:
            copy.recorded = True
            if copy.state is State.COMPLETING:
                self.done.completed(copy, "deferred completion")
            return
        self.losses.lose(copy, found.detail)

    # --- connection restarts ----------------------------------------------------------------

    def connection_lost(self) -> None:
        """The consumer's connection is closing (reentrant, no logging).

        Held copies cannot be acked on a new channel and the broker redelivers them: they
        are dropped. Claims of copies waiting for a lane or a rate (they never reached the
        pool) are released, so their redelivered copies do not wait for a lease nobody will finish.
        Copies in the pool keep their claims.
        """
        self._loop_bound = False
        if self.w.lanes is not None:
            self.w.lanes.drop_all()
        self.rates.drop_all()
        # kombu's loop resets its hub as it ends: the waker is attached again on restart
        self.w.waker.close()
        for copy in self.reg.copies(State.RECEIVED, State.HELD):
            self.holds.cancel_timer(copy)
            with contextlib.suppress(IllegalMove):  # it moved on meanwhile
                self.reg.move(copy, State.GONE)
        for copy in self.reg.copies(State.WAITING):
            with contextlib.suppress(Exception):
                self.ends.release(copy, "connection closed before it ran")
        # Celery flushes the pool's outbound buffer on a connection loss ("the broker
        # redelivers them"): a copy not started yet may never start, and its claim would hold
        # the redelivered copy until the start timeout. It gets one lease to start instead;
        # after that it is given up, and its pool process, should it start it after all,
        # checks the claim with the store (the lease it was handed has run out by then).
        # the channel's unacked deliveries are restored by kombu as it closes; a completion that
        # was to ride an ack is written by the keeper, and the message's copies are skipped
        self.done.riding.clear()
        soon = time.monotonic() + self.w.settings.lease_ms / 1000
        for copy in self.reg.copies():
            copy.delivery = None
            copy.ride_tag = None
            if copy.state is State.QUEUED:
                copy.start_by = min(copy.start_by, soon)
        self.w.slots.bind(None, 0)


def _announce_claim(copy: Copy, result: Success | TookOver) -> None:
    """Log a takeover, and send ``claim_acquired`` for a granted claim."""
    took_over = isinstance(result, TookOver)
    previous = result.previous_owner if isinstance(result, TookOver) else None
    if took_over:
        logger.info(
            "Claim %s: took over from %s (instance %d)", copy.claim_id, previous, copy.instance
        )
    key = copy.key
    # a keyed copy that was held until now gets its key (`claims key`)
    waited_key = key.field if key is not None and copy.hold_reason else ""
    if took_over or waited_key:
        if not signals.claim_acquired.receivers:
            return
    elif not signals.plain_acquisition_heard():
        # a plain acquisition: sent only where a receiver acts on it (the task history, by
        # default, acts on takeovers and waited keys alone): no arguments built per message
        return
    signals.claim_acquired.send(
        sender=copy.request.task,
        request=copy.request,
        token=copy.token,
        took_over=took_over,
        previous_owner=previous,
        claim_id=copy.claim_id,
        waited_key=waited_key,
    )
