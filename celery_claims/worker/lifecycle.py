"""The lifecycle of a delivered copy: one state machine, the only code that changes it.

Every message the claim gate sees becomes a :class:`Copy` with a :class:`State`. The legal
moves are :data:`TRANSITIONS` (and docs/semantics.md, "The lifecycle of a delivered copy");
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

Threads: the gate, timers and pool callbacks of prefork and solo call in from the consumer's
event loop, the thread pool's callbacks from its threads, the lease keeper from its own. Store
calls are made outside the lock; broker calls are made on the consumer's thread
(``consumer.call_soon``) unless the caller is on it.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery.exceptions import Ignore, Reject, Retry
from celery.utils.log import get_logger
from celery.worker.state import task_ready

from celery_claims.claims.keys import owner_task_key
from celery_claims.claims.redis import RedisClaimManager, ScriptCall
from celery_claims.errors import BackendUnavailable, ClaimError, ClaimTokenError, KeyRefused
from celery_claims.model import AlreadyClaimed, AlreadyDone, ClaimToken, Success, TookOver
from celery_claims.worker import signals
from celery_claims.worker.compat import (
    BrokerRide,
    Delivery,
    LoopWaker,
    before_gone,
    fail_unrun,
    forget_delivery,
    message_state,
    republish,
    requeued,
    result_ready,
    revoke_unrun,
)
from celery_claims.worker.failover import RecentCompletions
from celery_claims.worker.guard import (
    REQUEST_KEY,
    ClaimUnverified,
    StaleCopy,
    records_left_to_worker,
)
from celery_claims.worker.identity import new_owner
from celery_claims.worker.keyed import RESCHEDULES_HEADER, KeyedClaim
from celery_claims.worker.lanes import Lane, LaneSlot, WorkerLanes
from celery_claims.worker.recovery import Recovery, Verdict, record_done, recover
from celery_claims.worker.settings import ClaimsSettings
from celery_claims.worker.signals import Counters

__all__ = ["TRANSITIONS", "Copy", "Lifecycle", "SlotLedger", "State"]

logger = get_logger("celery_claims.worker")


class State(enum.Enum):
    """Where a delivered copy is in its lifecycle."""

    #: in the gate, its claim asked for
    RECEIVED = "received"
    #: kept unacked and re-checked on a timer (another copy's live lease, or the store is down)
    HELD = "held"
    #: claimed, waiting for a slot of its lane
    WAITING = "waiting"
    #: claimed and handed to the pool, not started yet
    QUEUED = "queued"
    #: the pool started it
    RUNNING = "running"
    #: its body returned; the completion record is not written yet (the store is unreachable)
    COMPLETING = "completing"
    #: another copy owns the task, or this copy was given up: it must never start, its
    #: outcome is discarded, and its message is let go when the pool is done with it
    STALE = "stale"
    #: completion recorded; Celery's handler acked the message (terminal)
    DONE = "done"
    #: the attempt ended without success, its claim released; Celery's handler ran (terminal)
    RELEASED = "released"
    #: acked without running: the task is recorded done, or given up as poison (terminal)
    SKIPPED = "skipped"
    #: let go without acking: forgotten, handed back, or its connection closed (terminal)
    GONE = "gone"


#: A copy in the pool: taken-over copies take turns there (Lifecycle._in_turn).
_IN_POOL = frozenset({State.QUEUED, State.RUNNING})

#: Reasons of a skip whose task id never ran (a keyed task meeting another's key): its own
#: result is stored as REVOKED.
_NOT_RUN = frozenset({"key_held", "key_done"})

#: The legal moves. Anything else is a bug, and raises.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.RECEIVED: frozenset({State.HELD, State.WAITING, State.QUEUED, State.SKIPPED, State.GONE}),
    State.HELD: frozenset({State.HELD, State.WAITING, State.QUEUED, State.SKIPPED, State.GONE}),
    State.WAITING: frozenset({State.QUEUED, State.RECEIVED, State.RELEASED}),
    State.QUEUED: frozenset(
        {State.RUNNING, State.COMPLETING, State.DONE, State.RELEASED, State.STALE, State.GONE}
    ),
    State.RUNNING: frozenset(
        {State.COMPLETING, State.DONE, State.RELEASED, State.STALE, State.GONE}
    ),
    State.COMPLETING: frozenset({State.DONE, State.STALE}),
    State.STALE: frozenset({State.GONE}),
    State.DONE: frozenset(),
    State.RELEASED: frozenset(),
    State.SKIPPED: frozenset(),
    State.GONE: frozenset(),
}

#: Event loop ticks an ended copy's settlement waits for Celery's scheduled ack or reject.
#: kombu's hub runs one tick's callbacks in no set order (``Hub._ready`` is a set, kombu 5.3
#: to 5.7), so the ack may come one tick after a callback scheduled behind it.
_SETTLE_TICKS = 2

#: States whose claim the keeper renews.
RENEWED = frozenset({State.WAITING, State.QUEUED, State.RUNNING, State.COMPLETING})

#: Exceptions that end an attempt with a successor message (or none needed): record done.
#: ``Retry`` has published the next attempt; ``Ignore`` is what ``Task.replace`` raises after
#: publishing the replacement (and a task raising it asks for no re-run).
_DONE_EXCEPTIONS = (Retry, Ignore)


@dataclass(eq=False)
class Copy:
    """One delivered copy of a task message, from the gate until it ends.

    Attributes:
        request: the worker's ``Request``.
        owner: the owner string of this copy's claims (one execution attempt).
        queue_id: the queue the claim is taken in.
        task_key: the claim's task id, ``<task id>:<retries>:<nesting>`` (the attempt).
        lease_ms: the lease of its claim.
        guarded: its pool process records the completion itself (see ``guard.py``).
        delivery: its Redis delivery, whose ``unacked_index`` score the keeper refreshes.
        state: where it is.
        token: its claim, once acquired (renewals update ``expires_at``).
        hold_reason: ``"held"`` or ``"unavailable"`` while held.
        delay_ms: the current re-check delay while held.
        timer_entry: the pending re-check.
        start_by: when it must have started (``time.monotonic()``), or it is given up.
        lane_slot: the lane slot it holds, if its message is in a lane.
        stale_why: why it is stale (empty unless it went stale).
        other_owner: another copy owns a live lease on the task (a stale copy may then be
            acked where it has a delivery of its own).
        handed_back: its message was handed back to the broker already.
        recorded: its completion is recorded (by its pool process): stop renewing.
        renew_sent_at: when its claim was granted or its last renewal sent
            (``time.monotonic()``); the keeper renews it one period of its own lease later.
        deferred_ack: the ack that waits for the completion record (made once it is written).
        ride_tag: its delivery tag while Celery's coming ack is to write its completion.
        time_limit_s: its time limit (hard, else soft; the message's, the task's or the
            worker's), or None.
        renew_until: when its claim stops being renewed (``time.monotonic()``): its start
            plus its time limit, which some pools do not enforce (:meth:`Lifecycle.overran`).
        overran: it ran past its time limit (reported once).
        key: its keyed claim (``claims_key``): ``queue_id`` and ``task_key`` are then the
            key's claim queue and field, and ``owner`` names the attempt (``keyed.py``).
        lane_key: its key in a keyed lane (``""`` when it is in none).
        mark_start: its claim was granted by a takeover under ``claims_max_takeovers``: its
            start is marked in the store (by its pool process, ``guard.py``; by this process
            for an unguarded task), so that it counts toward the limit only once started.
        pool_settles: the process that runs its body records the completion and removes
            the delivery from kombu's unacked set in one script, before it reports success
            (:meth:`Lifecycle.pool_settle`): Celery's ack then costs no round trip.
    """

    request: Any
    owner: str
    queue_id: str
    task_key: str
    lease_ms: int
    guarded: bool
    delivery: Delivery | None = None
    state: State = State.RECEIVED
    token: ClaimToken | None = None
    hold_reason: str = ""
    delay_ms: int = 0
    timer_entry: Any = None
    start_by: float = 0.0
    lane_slot: LaneSlot | None = None
    stale_why: str = ""
    other_owner: bool = False
    handed_back: bool = False
    recorded: bool = False
    renew_sent_at: float = 0.0
    deferred_ack: Callable[[], object] | None = None
    ride_tag: Any = None
    time_limit_s: float | None = None
    renew_until: float = math.inf
    overran: bool = False
    key: KeyedClaim | None = None
    lane_key: str = ""
    mark_start: bool = False
    pool_settles: bool = False

    @property
    def claim_id(self) -> str:
        """``queue/task:retries:nesting``, for logs."""
        return f"{self.queue_id}/{self.task_key}"

    @property
    def instance(self) -> int:
        """The fencing number of its claim (0 before it has one)."""
        return self.token.instance if self.token is not None else 0

    @property
    def fenced(self) -> bool:
        """True once it is known stale: its outcome is never recorded."""
        return bool(self.stale_why)


class SlotLedger:
    """Prefetch slots given back for held and lane-waiting copies, bounded by the window.

    Celery raises the prefetch count for an ETA request so the rest of the queue keeps
    flowing; a held copy does the same, but at most ``window`` of them at once (the worker's
    initial prefetch count), so one worker never pulls the whole queue into its held set.
    Copies waiting for a lane are not bounded (:meth:`give_back`).
    """

    def __init__(self) -> None:
        self.qos: Any = None
        self.window = 0
        self._given: set[int] = set()
        self._bounded: set[int] = set()
        self._lock = threading.Lock()

    def bind(self, qos: Any, window: int) -> None:
        """Use the consumer's QoS; ``window`` 0 means unbounded (no prefetch limit)."""
        with self._lock:
            self.qos = qos
            self.window = window
            self._given.clear()
            self._bounded.clear()

    def give_back(self, copy: Copy, *, bounded: bool = True) -> bool:
        """Give ``copy``'s prefetch slot back; True if it was (or already had been).

        ``bounded``: only while fewer than ``window`` bounded copies have theirs back. Copies
        waiting for a full lane are not bounded: the lane's limit holds fleet-wide whoever
        holds its messages, and the worker's other queues must keep flowing meanwhile.
        """
        with self._lock:
            if id(copy) in self._given:
                return True
            if self.qos is None:
                return False
            if bounded:
                if self.window and len(self._bounded) >= self.window:
                    return False
                self._bounded.add(id(copy))
            self._given.add(id(copy))
        self.qos.increment_eventually()
        return True

    def take_back(self, copy: Copy) -> None:
        """Take the slot given back for ``copy`` (if any) again."""
        with self._lock:
            if id(copy) not in self._given:
                return
            self._given.discard(id(copy))
            self._bounded.discard(id(copy))
        self.qos.decrement_eventually()


class Lifecycle:
    """Every delivered copy of one worker, and every move between states (module docstring).

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
    """

    def __init__(
        self,
        settings: ClaimsSettings,
        manager: RedisClaimManager,
        counters: Counters,
        lanes: WorkerLanes | None,
        hostname: str,
    ) -> None:
        self.settings = settings
        self.hostname = hostname
        self.manager = manager
        self.counters = counters
        self.lanes = lanes
        self.slots = SlotLedger()
        #: wakes the consumer's loop for a call from another thread (kombu before 5.7)
        self.waker = LoopWaker()
        #: the worker's pool, to terminate a stale copy's process (set when the worker starts)
        self.pool: Any = None
        self._consumer: Any = None
        self._dispatch: Callable[[Copy], None] | None = None
        self._recheck: Callable[[Copy], None] | None = None
        self._loop_thread = -1
        self._lock = threading.Lock()
        self._copies: dict[int, Copy] = {}
        #: taken-over copies waiting for their turn: one at a time in the pool (_in_turn)
        self._suspects: collections.deque[Copy] = collections.deque()
        self.ride_acks = False
        self.records_left = False
        #: sends a call on the consumer's pipe, its outcome to the callback on the event loop;
        #: False if it cannot (no pipe, another thread): the caller then writes it blocking
        self._send: Callable[[ScriptCall[Any], Callable[[Any], None]], bool] = (
            lambda call, callback: False
        )
        #: wakes the lease keeper (set by it): a claim's lease is too short for its period
        self.wake_keeper: Callable[[], object] = lambda: None
        #: told ``(queue_id, task_key, done)`` when a copy's message is acked for good (its
        #: publish journal entry can go; ``done``: the attempt is recorded done or given up;
        #: set by the runtime)
        self.on_settled: Callable[[str, str, bool], object] = lambda queue_id, key, done: None
        self._riding: dict[Any, tuple[Copy, BrokerRide]] = {}
        #: completions recorded lately, written again after a Sentinel failover (failover.py)
        self.recent = RecentCompletions()
        if lanes is not None:
            lanes.slots = self.slots
            lanes.waker = self.waker

    # --- wiring (consumer bootstep) ---------------------------------------------------------

    def bind(
        self,
        consumer: Any,
        dispatch: Callable[[Copy], None],
        recheck: Callable[[Copy], None],
        send: Callable[[ScriptCall[Any], Callable[[Any], None]], bool] | None = None,
    ) -> None:
        """Attach the consumer (timer, QoS, ``call_soon``), the gate's pool hand-off and its
        pipe (``send``)."""
        self._consumer = consumer
        self._dispatch = dispatch
        self._recheck = recheck
        if send is not None:
            self._send = send
        if self.lanes is not None:
            self.lanes.bind(consumer, self.lane_granted)

    def loop_started(self) -> None:
        """The consumer (re)started, on its loop's thread: the loop can be woken again."""
        self.waker.attach(self._consumer)

    def on_loop(self) -> None:
        """The caller is the consumer's event loop (the gate calls this for each message)."""
        self._loop_thread = threading.get_ident()
        self.waker.attach(self._consumer)
        if self.slots.qos is not self._consumer.qos:
            self.slots.bind(self._consumer.qos, int(self._consumer.initial_prefetch_count or 0))

    # --- the registry -----------------------------------------------------------------------

    def copies(self, *states: State) -> list[Copy]:
        """The live copies in any of ``states`` (all live copies without arguments)."""
        with self._lock:
            if not states:
                return list(self._copies.values())
            return [c for c in self._copies.values() if c.state in states]

    def renewed(self) -> list[Copy]:
        """The copies whose claims the keeper renews (not those past their time limit)."""
        now = time.monotonic()
        with self._lock:
            return [
                c
                for c in self._copies.values()
                if c.state in RENEWED and not c.recorded and not _past_limit(c, now)
            ]

    def refreshed(self) -> list[Copy]:
        """The copies whose Redis deliveries the keeper keeps from being restored: claimed or
        held ones, not those past their time limit (their message must come back)."""
        now = time.monotonic()
        live = (State.HELD, State.WAITING, State.QUEUED, State.RUNNING, State.COMPLETING)
        return [c for c in self.copies(*live) if not _past_limit(c, now)]

    def overran(self, now: float) -> list[Copy]:
        """Running copies past their time limit, not reported yet (:meth:`time_limit_passed`)."""
        return [c for c in self.copies(State.RUNNING) if not c.overran and _past_limit(c, now)]

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
        self.counters.incr("time_limit_overruns")
        request = copy.request
        logger.warning(
            "Claim %s: %s[%s] has run past its time limit (%g s), which this pool did not "
            "enforce; its claim is no longer renewed: it expires within claims_lease_ms and "
            "another copy takes the task over",
            copy.claim_id,
            request.name,
            request.id,
            copy.time_limit_s,
        )

    def held(self) -> list[Copy]:
        """The copies held unacked now."""
        return self.copies(State.HELD)

    def _move(self, copy: Copy, to: State, *, only_from: frozenset[State] | None = None) -> bool:
        """Move ``copy`` to ``to``; False (nothing changed) if it is not in ``only_from``.

        Raises:
            AssertionError: the move is not in :data:`TRANSITIONS` (a bug).
        """
        with self._lock:
            if only_from is not None and copy.state not in only_from:
                return False
            if to not in TRANSITIONS[copy.state]:
                raise AssertionError(f"claim {copy.claim_id}: illegal move {copy.state} -> {to}")
            was, copy.state = copy.state, to
            if TRANSITIONS[to]:
                self._copies[id(copy)] = copy
            else:
                self._copies.pop(id(copy), None)
        if copy.mark_start and was in _IN_POOL and to not in _IN_POOL:
            self._turn_over()
        return True

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
    ) -> Copy:
        """A new copy in the gate (``RECEIVED``); ``key``: its keyed claim, if any;
        ``lane_key``: its key in a keyed lane, if it is in one."""
        refresh = self.settings.refresh_unacked
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
        )
        with self._lock:
            self._copies[id(copy)] = copy
        return copy

    def acquired(self, copy: Copy, result: Success | TookOver, lane: Lane | None) -> None:
        """The claim was granted: to the lane (``WAITING``) or the pool (``QUEUED``)."""
        assert result.token is not None
        took_over = isinstance(result, TookOver)
        copy.token = result.token
        # a keyed claim is claimed without a takeover limit (gate.py): nothing to mark
        copy.mark_start = took_over and self.settings.max_takeovers is not None and copy.key is None
        copy.renew_sent_at = time.monotonic()
        if self.settings.renew_interval_for(copy.lease_ms) < self.settings.renew_interval_ms:
            self.wake_keeper()
        copy.request.claim = copy
        self._cancel_timer(copy)
        self.slots.take_back(copy)
        self.counters.incr("took_over" if took_over else "acquired")
        if isinstance(result, TookOver):
            logger.info(
                "Claim %s: took over from %s (instance %d)",
                copy.claim_id,
                result.previous_owner,
                copy.instance,
            )
        signals.claim_acquired.send(
            sender=copy.request.task,
            request=copy.request,
            token=copy.token,
            took_over=took_over,
            previous_owner=result.previous_owner if isinstance(result, TookOver) else None,
        )
        if lane is not None and self.lanes is not None:
            self._move(copy, State.WAITING)
            self.lanes.admit(lane, copy)
        else:
            self._in_turn(copy)

    def lane_granted(self, copy: Copy, slot: LaneSlot) -> None:
        """A lane slot for a waiting copy (event loop): to the pool."""
        if copy.state is not State.WAITING:
            if self.lanes is not None:
                self.lanes.release(slot)
            return
        copy.lane_slot = slot
        self.slots.take_back(copy)
        self._in_turn(copy)

    def _in_turn(self, copy: Copy) -> None:
        """To the pool, unless it is a taken-over copy and another is in the pool: then it
        waits for its turn (``WAITING``, its claim renewed and its start unmarked).

        A takeover means the task's last holder died while it ran it, and a task that kills
        its worker (its whole process group: an OOM kill, a segfault, ``os.killpg``) takes
        the tasks beside it down too. Their messages come back together, the next worker
        takes them together, and without turns every one of them dies again with the poison
        task, until the takeover limit gives them all up. One taken-over copy at a time in the
        pool isolates the task that kills: a copy that waits does not start, so its holder's
        death does not count toward its takeover limit. Other copies run beside it as usual.
        """
        if copy.mark_start:
            with self._lock:
                busy = any(
                    c is not copy and c.mark_start and c.state in _IN_POOL
                    for c in self._copies.values()
                )
                if busy:
                    # WAITING and in the queue of turns at once: _next_turn never sees one
                    # without the other
                    if copy.state is not State.WAITING:
                        if State.WAITING not in TRANSITIONS[copy.state]:
                            raise AssertionError(
                                f"claim {copy.claim_id}: illegal move {copy.state} -> waiting"
                            )
                        copy.state = State.WAITING
                    self._suspects.append(copy)
            if busy:
                logger.info(
                    "Claim %s: taken over; waits for this worker's other taken-over task to "
                    "end (one at a time, so a task that kills its worker takes no other down)",
                    copy.claim_id,
                )
                return
        self._to_pool(copy)

    def _turn_over(self) -> None:
        """A taken-over copy left the pool: the next one's turn (on the event loop)."""
        if self._suspects:
            self._on_loop(self._next_turn)

    def _next_turn(self) -> None:
        with self._lock:
            if any(c.mark_start and c.state in _IN_POOL for c in self._copies.values()):
                return
            turn = None
            while self._suspects and turn is None:
                waiting = self._suspects.popleft()
                if waiting.state is State.WAITING:
                    turn = waiting
        if turn is not None:
            self._to_pool(turn)

    def _out_of_turn(self, copy: Copy) -> None:
        """A copy waiting for its turn leaves ``WAITING`` otherwise (lost, released)."""
        with self._lock, contextlib.suppress(ValueError):
            self._suspects.remove(copy)

    def _to_pool(self, copy: Copy) -> None:
        self._move(copy, State.QUEUED)
        copy.start_by = time.monotonic() + self.settings.start_timeout_ms / 1000
        assert self._dispatch is not None
        self._dispatch(copy)

    def skip(self, copy: Copy, record: Any, reason: str) -> None:
        """The task is recorded done (or given up): ack without running (``SKIPPED``)."""
        self._cancel_timer(copy)
        self.slots.take_back(copy)
        self._move(copy, State.SKIPPED)
        request = copy.request
        self.counters.incr("skipped_done" if reason == "done" else f"skipped_{reason}")
        logger.info(
            "Skipped %s[%s]: %s; acked without running",
            request.name,
            request.id,
            # a keyed skip names the key and the task that held (or did) it
            f"key {copy.task_key} was done by task {_holder_task_id(record)} ({record.owner})"
            if reason == "key_done"
            else f"key {copy.task_key} {_skip_detail(record)}"
            if reason == "key_held"
            else f"claim {copy.claim_id} {_skip_detail(record)}",
        )
        # only the message goes: the result the first run stored stays as it is
        # the journal entry first (see _settle_before_gone), then the ack
        self.on_settled(copy.queue_id, copy.task_key, reason in ("done", "given_up"))
        request.acknowledge()
        task_ready(request)
        signals.task_skipped.send(
            sender=request.task,
            request=request,
            reason=reason,
            claim_id=copy.claim_id,
            record=record,
            holder_task_id=_holder_task_id(record),
        )
        if reason in _NOT_RUN:
            # another task id held or finished the key: this one's own result says so (for a
            # copy of a finished attempt, the result its run stored stays). Stored last, so a
            # client that sees it finds the journal's entry too
            try:
                revoke_unrun(request, f"{reason}: {_skip_detail(record)}")
            except Exception as exc:
                logger.warning(
                    "Skipped %s[%s]: result not stored: %r", request.name, request.id, exc
                )

    def reschedule(self, copy: Copy, holder: AlreadyClaimed) -> None:
        """Another task holds the copy's key (``reschedule`` policy): its message is
        published again with a countdown, then this copy is acked (``SKIPPED``).

        The new message is a durable copy of the work before this one goes. Should the
        publish fail, the copy is held instead (``wait``), so nothing is lost.
        """
        key = copy.key
        assert key is not None
        count = key.reschedules + 1
        request = copy.request
        try:
            republish(request, key.spec.reschedule_s, {RESCHEDULES_HEADER: count})
        except Exception as exc:
            logger.warning(
                "Claim %s: could not reschedule %s[%s] (%r); held instead",
                copy.claim_id,
                request.name,
                request.id,
                exc,
            )
            self.hold(copy, "held", holder=holder.owner, error=None)
            return
        self._cancel_timer(copy)
        self.slots.take_back(copy)
        self._move(copy, State.SKIPPED)
        self.counters.incr("rescheduled_key_held")
        logger.info(
            "Rescheduled %s[%s] in %g s (%d of at most %d): claim %s %s",
            request.name,
            request.id,
            key.spec.reschedule_s,
            count,
            key.spec.reschedule_max,
            copy.claim_id,
            _skip_detail(holder),
        )
        request.acknowledge()
        task_ready(request)
        signals.task_skipped.send(
            sender=request.task,
            request=request,
            reason="key_rescheduled",
            claim_id=copy.claim_id,
            record=holder,
            holder_task_id=_holder_task_id(holder),
        )

    def refuse(self, request: Any, error: KeyRefused, queue_id: str, task_key: str) -> None:
        """A keyed task's message whose key cannot be made: never run, recorded as failed
        with ``error`` (its result, ``task_failure``, the ``task-failed`` event), then acked,
        as Celery fails a task whose arguments do not bind. Never a claim, never a copy;
        its publish journal entry (``queue_id``, ``task_key``: the attempt's) is cleared.
        """
        self.counters.incr("refused_key")
        logger.error(
            "Refused %s[%s]: %s; recorded as failed, acked without running",
            request.name,
            request.id,
            error,
        )
        try:
            fail_unrun(request, error)
        except Exception as exc:
            # the result backend is down: the message stays unacked, the broker redelivers
            # it and it is refused again; never acked without its failure recorded
            logger.warning(
                "Refused %s[%s]: failure not recorded: %r", request.name, request.id, exc
            )
            return
        # no record says it is over: without its entry cleared, journal recovery would
        # publish it again (to be refused again), up to claims_journal_max_republish times;
        # cleared before the ack (see _settle_before_gone)
        self.on_settled(queue_id, task_key, False)
        request.acknowledge()
        task_ready(request)
        signals.task_skipped.send(
            sender=request.task,
            request=request,
            reason="key_refused",
            claim_id="",
            record=None,
            holder_task_id=None,
            error=error,
        )

    def hold(
        self, copy: Copy, reason: str, *, holder: str | None, error: BaseException | None
    ) -> None:
        """Keep the copy unacked and re-check it later (``HELD``).

        A copy held by another copy's live lease gives its prefetch slot back (within the
        window), so the queue keeps flowing; a copy held because the store is unreachable
        keeps it: nothing can run while the store is down, and taking more messages would
        only hoard them away from other workers.
        """
        settings = self.settings
        first = copy.state is not State.HELD
        changed = copy.hold_reason != reason
        self._move(copy, State.HELD)
        copy.hold_reason = reason
        if reason == "held":
            self.slots.give_back(copy)
            copy.delay_ms = settings.held_recheck_ms
        else:
            copy.delay_ms = (
                settings.unavailable_retry_ms
                if first or changed or copy.delay_ms == 0
                else min(copy.delay_ms * 2, settings.unavailable_retry_max_ms)
            )
        recheck_s = copy.delay_ms / 1000
        request = copy.request
        if first or changed:
            self.counters.incr("held_unavailable" if reason == "unavailable" else "held")
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
                    copy.claim_id,
                    holder,
                    recheck_s,
                )
            signals.task_held.send(
                sender=request.task,
                request=request,
                reason=reason,
                claim_id=copy.claim_id,
                holder=holder,
                recheck_s=recheck_s,
                key=copy.key.field if copy.key is not None else "",
            )
        else:
            self.counters.incr("rechecks")
        copy.timer_entry = self._consumer.timer.call_after(
            recheck_s, self._on_recheck, (copy,), priority=6
        )

    def _on_recheck(self, copy: Copy) -> None:
        copy.timer_entry = None
        if copy.state is State.HELD and self._recheck is not None:
            self._recheck(copy)

    def _cancel_timer(self, copy: Copy) -> None:
        entry, copy.timer_entry = copy.timer_entry, None
        if entry is not None:
            with contextlib.suppress(Exception):
                self._consumer.timer.cancel(entry)

    # --- the pool's callbacks ---------------------------------------------------------------

    def started(self, copy: Copy) -> None:
        """The pool started the copy (``on_accepted``): ``QUEUED`` -> ``RUNNING``."""
        if copy.time_limit_s is not None:
            copy.renew_until = time.monotonic() + copy.time_limit_s
        self._move(copy, State.RUNNING, only_from=frozenset({State.QUEUED}))
        if copy.mark_start and not copy.guarded and copy.token is not None:
            self._mark_started(copy.token)

    def _mark_started(self, token: ClaimToken) -> None:
        """Mark an unguarded copy's start (its pool process cannot): best effort, as in
        ``guard.py``, on the consumer's pipe where it can go there."""
        try:
            call = self.manager.mark_started_call(token)
            if not self._send(call, lambda outcome: None):
                self.manager.execute(call)
        except ClaimError as exc:
            logger.debug("Claim %s/%s: start not marked: %s", token.queue_id, token.task_id, exc)

    def pool_settle(self, copy: Copy) -> tuple[str, str, str] | None:
        """What the process running ``copy``'s body needs to settle it itself, or None.

        Where the claim store is the Redis broker's server and nothing after the body can
        fail the attempt (:func:`~.guard.records_left_to_worker`), the process that runs the
        body (a prefork child, a pool thread) writes the completion record and removes the
        delivery from kombu's ``unacked_index`` / ``unacked`` in one script, the one
        :meth:`take_ack` would send (``ack_done.lua``: the delivery goes only with this
        token's record), and waits for it before it reports success. A success reported for
        such a copy therefore means the record is written and the delivery removed: its ack
        only forgets the delivery in kombu's memory, so the event loop makes no round trip
        for it, and a main process paused or killed after the body returned cannot let the
        task run again. Any other outcome is reported as a failure (``StaleCopy``,
        ``ClaimUnverified``) and handled as before.

        Returns:
            kombu's unacked index and unacked keys and the delivery tag, for the request dict.
        """
        request = copy.request
        if not (copy.guarded and self.ride_acks) or request.acknowledged:
            return None
        if not records_left_to_worker(request):
            return None
        message = request.message
        tag = getattr(message, "delivery_tag", None)
        ride = BrokerRide.of(getattr(message, "channel", None), self.manager.client)
        if ride is None or tag is None:
            return None
        return (ride.keys[0], ride.keys[1], str(tag))

    def succeeded(self, copy: Copy, celery_handler: Callable[[], object]) -> None:
        """The body returned and the result was stored (``on_success``)."""
        if copy.state is State.STALE:
            self.counters.incr("fenced_success")
            self._let_go(copy, "succeeded after it went stale; nothing recorded")
            return
        if copy.state not in (State.QUEUED, State.RUNNING):
            self._repeat(copy, celery_handler)
            return
        if copy.guarded and self.ride_acks and not copy.request.acknowledged:
            if not self._ride(copy, celery_handler):
                # the pool process may have left the record to the ack, which cannot carry
                # it here: written from this process (it recognises a record already there)
                self._record(copy, "succeeded", celery_handler)
            return
        if copy.guarded and not (self.records_left and records_left_to_worker(copy.request)):
            # the pool process recorded the completion before the result was stored
            self._finish(copy, State.DONE, "succeeded")
            self.recent.add(copy.token)
            self.counters.incr("completed")
            celery_handler()
            self.on_settled(copy.queue_id, copy.task_key, True)
            return
        # an unguarded task, or one whose pool process left the record to this process
        self._record(copy, "succeeded", celery_handler, on_pipe=True)

    def _ride(self, copy: Copy, celery_handler: Callable[[], object]) -> bool:
        """Let Celery's ack of a succeeded copy write its completion (:meth:`take_ack`).

        On the Redis broker with the claim store on the same server, kombu's ack (two
        commands in one round trip) is replaced by one script that records the completion
        and removes the delivery only if the record is this copy's: the ack costs no round
        trip more than Celery's own, and the record and the ack are one step. False (nothing
        done) where that cannot apply: another transport or server.
        """
        request = copy.request
        message = request.message
        tag = getattr(message, "delivery_tag", None)
        ride = BrokerRide.of(getattr(message, "channel", None), self.manager.client)
        if ride is None or tag is None:
            return False
        self._finish(copy, State.COMPLETING, "succeeded")
        ride.hook_ack(self.take_ack)
        copy.ride_tag = tag
        self._riding[tag] = (copy, ride)
        # Celery schedules its ack on the event loop (consumer.call_soon_ack). Should it never
        # come, the keeper writes the record of a COMPLETING copy, and the message, unacked,
        # is redelivered and skipped.
        celery_handler()
        return True

    def take_ack(self, tag: Any) -> bool:
        """kombu's ack of ``tag`` (on the consumer's thread): True if a ride took it."""
        riding = self._riding.pop(tag, None)
        if riding is None:
            return False
        copy, ride = riding
        copy.ride_tag = None
        assert copy.token is not None
        if copy.pool_settles:
            # its pool process recorded the completion and removed the delivery before it
            # reported success (pool_settle): nothing of it is left in the broker
            ride.forget(tag)
            self._completed(copy, "succeeded, settled by its pool process")
            return True
        try:
            call = self.manager.ack_done_call(
                copy.token, self.settings.done_ttl_ms, ride.keys, str(tag)
            )
            self.manager.execute(call)
        except ClaimTokenError:
            # the claim changed meanwhile (re-claimed after a store restart, recorded under
            # another token, taken over): decided the slow way, the delivery left until then
            copy.deferred_ack = functools.partial(ride.ack, tag)
            self.complete_deferred(copy)
            return True
        except Exception as exc:
            # the store, the broker's own server, is unreachable (or a bug): keep renewing,
            # the keeper writes the record and then acks; until then nothing is acked
            copy.deferred_ack = functools.partial(ride.ack, tag)
            self.counters.incr("completion_deferred")
            logger.warning("Claim %s: succeeded, completion deferred: %s", copy.claim_id, exc)
            return True
        ride.forget(tag)
        self._completed(copy, "succeeded")
        return True

    def failed(
        self, copy: Copy, exc: BaseException | None, celery_handler: Callable[[], object]
    ) -> None:
        """The attempt ended without a success (``on_failure``; ``exc`` unwrapped)."""
        state = copy.state
        if state is State.STALE or isinstance(exc, StaleCopy):
            if isinstance(exc, StaleCopy):
                self.counters.incr("fenced_success")  # its guard discarded the outcome
            if state in (State.QUEUED, State.RUNNING):
                self._go_stale(copy, f"stale copy ended ({type(exc).__name__})", other_owner=True)
            self._let_go(copy, f"ended ({type(exc).__name__}) after it went stale")
            return
        if state not in (State.QUEUED, State.RUNNING):
            self._repeat(copy, celery_handler)
            return
        if isinstance(exc, ClaimUnverified):
            if exc.phase == "done":
                # the body returned: the record is written once the store answers, and the
                # message is acked only then (it may share its record with a live owner)
                task_ready(copy.request)
                copy.deferred_ack = copy.request.acknowledge
                self._finish(copy, State.COMPLETING, "body returned, claim unverifiable")
                self.counters.incr("completion_deferred")
                return
            self._hand_back(copy, f"claim unverifiable ({exc.phase})")
            return
        if isinstance(exc, _DONE_EXCEPTIONS):
            self._record(copy, type(exc).__name__.lower(), celery_handler)
            return
        why = "rejected" if isinstance(exc, Reject) else f"failed ({type(exc).__name__})"
        self._release(copy, why)
        self._settle_before_gone(copy, celery_handler)

    def timed_out(self, copy: Copy, soft: bool, celery_handler: Callable[[], object]) -> None:
        """A time limit fired (``on_timeout``); a hard one releases the claim."""
        if soft:
            celery_handler()
            return
        if copy.state in (State.QUEUED, State.RUNNING):
            self._release(copy, "hard time limit")
        if copy.state is State.RELEASED:
            self._settle_before_gone(copy, celery_handler)
        else:
            self._repeat(copy, celery_handler)

    def _settle_before_gone(self, copy: Copy, celery_handler: Callable[[], object]) -> None:
        """Run Celery's handler for an attempt that ended without a record; its journal entry
        is cleared just before the handler's ack or reject takes the message for good (not
        if it requeues it: ``Reject(requeue=True)``, ``task_reject_on_worker_lost``).

        Before, not after: a worker killed between the two then leaves the message unacked,
        for the broker to deliver again (at least once, as Celery promises a task that did
        not finish), where the other order left an acked message's entry for journal
        recovery to publish again. Where the request cannot be hooked, the entry is cleared
        after the handler, once the message is known gone.
        """
        settle = functools.partial(self.on_settled, copy.queue_id, copy.task_key, False)
        if before_gone(copy.request, settle):
            celery_handler()
            return
        celery_handler()
        self._settled_unless_requeued(copy)

    def _settled_unless_requeued(self, copy: Copy) -> None:
        """An ended attempt's message is gone unless Celery's handler requeued it
        (``Reject(requeue=True)``, ``task_reject_on_worker_lost``).

        Celery's handler may only have scheduled its ack or reject (``call_soon_ack`` puts
        it on the event loop): then the message's fate is read on the loop after it.
        """
        if message_state(copy.request) is None and self._consumer is not None:
            self.waker.call_soon(self._consumer, self._settled_if_gone, copy, _SETTLE_TICKS)
        else:
            self._settled_if_gone(copy, 0)

    def _settled_if_gone(self, copy: Copy, ticks: int) -> None:
        if message_state(copy.request) is None and ticks > 0 and self._consumer is not None:
            # kombu's hub keeps the callbacks of one tick in a set: this one may have run
            # before Celery's ack of the same tick; the ack has run by the next tick
            self.waker.call_soon(self._consumer, self._settled_if_gone, copy, ticks - 1)
            return
        if not requeued(copy.request):
            self.on_settled(copy.queue_id, copy.task_key, False)

    @staticmethod
    def _repeat(copy: Copy, celery_handler: Callable[[], object]) -> None:
        # A second report of an ended copy (a hard time limit reports twice). Celery's
        # handler runs again only where it ran the first time: a stale, handed back or
        # completing copy's message must not be acked, nor a FAILURE stored over another
        # copy's result.
        if copy.state in (State.DONE, State.RELEASED, State.SKIPPED):
            celery_handler()

    def revoked(self, copy: Copy) -> None:
        """Revoked before it ran: Celery acks it without a callback; release the claim."""
        if copy.state in (State.QUEUED, State.RUNNING):
            self.counters.incr("revoked_released")
            self._release(copy, "revoked")

    # --- the keeper's findings (keeper thread) ----------------------------------------------

    def renewal(self, copy: Copy, outcome: ClaimToken | ClaimTokenError) -> None:
        """Apply one renewal's outcome: the new token, or a refused one to resolve."""
        if isinstance(outcome, ClaimToken):
            copy.token = outcome
            self.counters.incr("renewals")
            return
        with self._lock:
            if copy.state not in RENEWED or copy.recorded:
                return  # it ended (or recorded) between the snapshot and the renewal
        try:
            assert copy.token is not None
            found = recover(self.manager, copy.token, outcome, copy.lease_ms)
        except ClaimError as exc:
            logger.warning("Claim %s: renewal refused, cannot resolve now: %s", copy.claim_id, exc)
            return
        self._resolved(copy, found)

    def _resolved(self, copy: Copy, found: Recovery) -> None:
        if found.verdict is Verdict.OURS:
            assert found.token is not None
            copy.token = found.token
            if found.reclaimed:
                self.counters.incr("reclaimed")
                logger.warning(
                    "Claim %s: the claim store had lost it (restart or failover); claimed it "
                    "again (instance %d)",
                    copy.claim_id,
                    copy.instance,
                )
            if copy.state is State.COMPLETING:
                self.complete_deferred(copy)
            return
        if found.verdict is Verdict.RECORDED:
            copy.recorded = True
            if copy.state is State.COMPLETING:
                self._completed(copy, "deferred completion")
            return
        self._lose(copy, found.detail)

    def _lose(self, copy: Copy, detail: str) -> None:
        """Another copy owns the task now: this one must not start, or is stopped."""
        state = copy.state
        if state is State.COMPLETING:
            # its body ran, but the record could not be written before another copy took
            # the task: that copy's outcome counts; this one's message is let go
            logger.warning(
                "Claim %s: completion not recorded, another copy owns the task now (%s)",
                copy.claim_id,
                detail,
            )
            self._go_stale(copy, f"completion not recorded ({detail})", other_owner=True)
            self._let_go(copy, "body ended before another copy took over")
            return
        if state is State.WAITING:
            # never started: it goes through the gate again as a duplicate (held until the
            # owner finishes, or taken over if it dies). It leaves WAITING here, under the
            # lock, so the keeper stops renewing it and a lane grant cannot send it to the
            # pool before the loop runs the readmission (the loss is decided once)
            if not self._move(copy, State.RECEIVED, only_from=frozenset({State.WAITING})):
                return
            self._out_of_turn(copy)
        elif not self._go_stale(copy, f"lease lost ({detail})", other_owner=True):
            return
        request = copy.request
        self.counters.incr("lease_lost")
        logger.warning(
            "Claim %s: lease lost (%s); %s[%s] is fenced, its result will not be recorded",
            copy.claim_id,
            detail,
            request.name,
            request.id,
        )
        signals.lease_lost.send(
            sender=request.task,
            request=request,
            token=copy.token,
            error=StaleCopy(f"claim instance {copy.instance} was taken over ({detail})"),
        )
        if state is State.RUNNING:
            self._stop(copy)
        elif state is State.WAITING:
            self._on_loop(self._readmit, copy)

    def complete_deferred(self, copy: Copy) -> None:
        """Retry a completion the store could not take (``COMPLETING``)."""
        if copy.state is not State.COMPLETING:
            return
        try:
            found = self._record_done(copy)
        except ClaimError as exc:
            logger.debug("Claim %s: completion still deferred: %s", copy.claim_id, exc)
            return
        if found.verdict is Verdict.LOST:
            self._lose(copy, found.detail)
        else:
            if found.reclaimed:
                logger.warning(
                    "Claim %s: the claim store had lost it; recorded done all the same",
                    copy.claim_id,
                )
            self._completed(copy, "deferred completion")

    def start_overdue(self, copy: Copy) -> None:
        """The pool did not start the copy in ``claims_start_timeout_ms``: give it up.

        Its claim is released and its message handed back to the broker, so another worker
        runs it; if the pool starts it later after all, its pool process finds the claim is
        no longer its own and does not run it.
        """
        if not self._go_stale(copy, "not started in time", other_owner=False):
            return
        self.counters.incr("start_timeouts")
        request = copy.request
        logger.error(
            "Claim %s: the pool has not started %s[%s] in time (claims_start_timeout_ms, or a "
            "lease after a broker connection loss); given up: claim released, message handed "
            "back to the broker",
            copy.claim_id,
            request.name,
            request.id,
        )
        self._release_claim(copy, "not started in time")
        copy.handed_back = True  # before the pool can report it: its end must not settle it
        self._on_loop(self._requeue, copy)

    def started_late(self, now: float) -> list[Copy]:
        """The copies queued in the pool past their ``start_by``."""
        return [c for c in self.copies(State.QUEUED) if now > c.start_by]

    # --- connection restarts ----------------------------------------------------------------

    def connection_lost(self) -> None:
        """The consumer's connection is closing (reentrant, no logging).

        Held copies cannot be acked on a new channel and the broker redelivers them: they
        are dropped. Claims of copies waiting for a lane (they never reached the pool) are
        released, so their redelivered copies do not wait for a lease nobody will finish.
        Copies in the pool keep their claims.
        """
        if self.lanes is not None:
            self.lanes.drop_all()
        # kombu's loop resets its hub as it ends: the waker is attached again on restart
        self.waker.close()
        for copy in self.copies(State.RECEIVED, State.HELD):
            self._cancel_timer(copy)
            with contextlib.suppress(AssertionError):
                self._move(copy, State.GONE)
        for copy in self.copies(State.WAITING):
            with contextlib.suppress(Exception):
                self._release(copy, "connection closed before it ran")
        # Celery flushes the pool's outbound buffer on a connection loss ("the broker
        # redelivers them"): a copy not started yet may never start, and its claim would hold
        # the redelivered copy until the start timeout. It gets one lease to start instead;
        # after that it is given up, and its pool process, should it start it after all,
        # checks the claim with the store (the lease it was handed has run out by then).
        # the channel's unacked deliveries are restored by kombu as it closes; a completion that
        # was to ride an ack is written by the keeper, and the message's copies are skipped
        self._riding.clear()
        soon = time.monotonic() + self.settings.lease_ms / 1000
        for copy in self.copies():
            copy.delivery = None
            copy.ride_tag = None
            if copy.state is State.QUEUED:
                copy.start_by = min(copy.start_by, soon)
        self.slots.bind(None, 0)

    # --- endings ----------------------------------------------------------------------------

    def _finish(self, copy: Copy, to: State, why: str) -> bool:
        """Move a copy in the pool to ``to`` and free its lane slot."""
        if not self._move(copy, to, only_from=frozenset({State.QUEUED, State.RUNNING})):
            return False
        slot, copy.lane_slot = copy.lane_slot, None
        if slot is not None and self.lanes is not None:
            # the slot goes back first: the next task of the lane need not wait for the
            # store write of this one's completion
            self.lanes.release(slot)
        logger.debug("Claim %s: %s -> %s", copy.claim_id, why, to.value)
        return True

    def _record(
        self,
        copy: Copy,
        why: str,
        celery_handler: Callable[[], object],
        *,
        on_pipe: bool = False,
    ) -> None:
        """Record done from this process (retries, replacements, unguarded tasks, and tasks
        whose pool process left the record to it), then run Celery's handler (the ack).

        ``on_pipe``: send the record on the consumer's pipe where it can go there; Celery's
        handler then runs once it is recorded (:meth:`_completed`, by the reply or, should the
        reply not come, by the keeper), and the event loop goes on meanwhile.
        """
        if not self._finish(copy, State.COMPLETING, why):
            celery_handler()
            return
        if on_pipe and copy.token is not None:
            # the pool process may have sent the record ahead: found there, it counts
            call = self.manager.record_call(copy.token, self.settings.done_ttl_ms)
            copy.deferred_ack = celery_handler
            if self._send(call, functools.partial(self._record_replied, copy, why)):
                return
            copy.deferred_ack = None
        self._record_now(copy, why, celery_handler)

    def _record_replied(self, copy: Copy, why: str, outcome: Any) -> None:
        """The reply to a record sent on the pipe (event loop)."""
        if copy.state is not State.COMPLETING:
            return  # recorded meanwhile (the keeper), Celery's handler with it
        if not isinstance(outcome, BaseException):
            self._completed(copy, why)  # runs Celery's handler (copy.deferred_ack)
            return
        # refused (a store restart lost the claim, another copy took it) or not written:
        # decided the blocking way, as when it could not be sent
        handler, copy.deferred_ack = copy.deferred_ack, None
        unreachable = outcome if isinstance(outcome, BackendUnavailable) else None
        self._record_now(copy, why, handler or (lambda: None), unreachable=unreachable)

    def _record_now(
        self,
        copy: Copy,
        why: str,
        celery_handler: Callable[[], object],
        *,
        unreachable: BackendUnavailable | None = None,
    ) -> None:
        """Write the record of a ``COMPLETING`` copy (blocking), then run Celery's handler
        (``unreachable``: the store was found unreachable just now, it is not asked again)."""
        try:
            if unreachable is not None:
                raise unreachable
            found = self._record_done(copy)
        except BackendUnavailable as exc:
            # keep renewing it and retry from the keeper: the attempt is done, and a
            # duplicate must not take the claim over while the record cannot be written
            self.counters.incr("completion_deferred")
            logger.warning("Claim %s: %s, completion deferred: %s", copy.claim_id, why, exc)
            celery_handler()
            return
        except ClaimError as exc:
            logger.error("Claim %s: could not record completion: %s", copy.claim_id, exc)
            found = Recovery(Verdict.RECORDED, detail=str(exc))
        if found.verdict is Verdict.LOST:
            self._lose(copy, found.detail)
            return
        self._completed(copy, why)
        celery_handler()

    def _record_done(self, copy: Copy) -> Recovery:
        """Write the completion record of ``copy`` (one round trip; more only to recover)."""
        assert copy.token is not None
        return record_done(
            self.manager, copy.token, lease_ms=copy.lease_ms, done_ttl_ms=self.settings.done_ttl_ms
        )

    def _completed(self, copy: Copy, why: str) -> None:
        if not self._move(copy, State.DONE, only_from=frozenset({State.COMPLETING})):
            return
        if copy.ride_tag is not None:
            # recorded before Celery's ack came (by the keeper): kombu's own ack will do
            self._riding.pop(copy.ride_tag, None)
            copy.ride_tag = None
        self.recent.add(copy.token)
        self.counters.incr("completed")
        self.on_settled(copy.queue_id, copy.task_key, True)
        logger.debug("Claim %s: %s, recorded done", copy.claim_id, why)
        ack, copy.deferred_ack = copy.deferred_ack, None
        if ack is not None:
            self._on_loop(_quietly, ack, copy)

    def _release(self, copy: Copy, why: str) -> None:
        if copy.state is State.WAITING:
            self._out_of_turn(copy)
            slot, copy.lane_slot = copy.lane_slot, None
            if self.lanes is not None:
                self.lanes.forget(copy)
                if slot is not None:  # granted, then waiting for its turn
                    self.lanes.release(slot)
            self.slots.take_back(copy)
            self._move(copy, State.RELEASED)
        elif not self._finish(copy, State.RELEASED, why):
            return
        self._release_claim(copy, why)

    def _release_claim(self, copy: Copy, why: str) -> None:
        if copy.token is None:
            return
        try:
            self.manager.release(copy.token)
        except ClaimTokenError as exc:
            logger.debug("Claim %s: already gone at release (%s)", copy.claim_id, exc)
            return
        except ClaimError as exc:
            # nothing to retry: the lease is no longer renewed and expires by itself
            logger.warning("Claim %s: %s, release failed: %s", copy.claim_id, why, exc)
            return
        self.counters.incr("released")
        logger.debug("Claim %s: %s, released", copy.claim_id, why)
        signals.claim_released.send(
            sender=copy.request.task,
            request=copy.request,
            token=copy.token,
            claim_id=copy.claim_id,
            reason=why,
        )

    def _go_stale(self, copy: Copy, why: str, *, other_owner: bool) -> bool:
        with self._lock:
            if copy.state not in (State.QUEUED, State.RUNNING, State.COMPLETING):
                return False
            was, copy.state = copy.state, State.STALE
            copy.stale_why = why
            copy.other_owner = other_owner
        if copy.mark_start and was in _IN_POOL:
            self._turn_over()
        slot, copy.lane_slot = copy.lane_slot, None
        if slot is not None and self.lanes is not None:
            self.lanes.release(slot)
        return True

    def _let_go(self, copy: Copy, why: str) -> None:
        """End a stale copy without touching another copy's record (``STALE`` -> ``GONE``)."""
        if not self._move(copy, State.GONE, only_from=frozenset({State.STALE})):
            return
        request = copy.request
        task_ready(request)
        if copy.handed_back:
            return
        self._on_loop(self._settle_stale, copy)
        logger.warning(
            "Claim %s: stale copy of %s[%s] %s; nothing stored, message let go",
            copy.claim_id,
            request.name,
            request.id,
            why,
        )

    def _settle_stale(self, copy: Copy) -> None:
        request = copy.request
        if forget_delivery(request):
            return  # Redis: the record in unacked is the live owner's too; leave it alone
        # a delivery of its own: ack it where another copy owns a live lease (that copy is
        # durable), hand it back otherwise
        with contextlib.suppress(Exception):
            if copy.other_owner:
                request.acknowledge()
            else:
                request.reject(requeue=True)

    def _hand_back(self, copy: Copy, why: str) -> None:
        """The copy did not run and cannot be verified: its message goes back to the broker."""
        if not self._finish(copy, State.GONE, why):
            return
        task_ready(copy.request)
        self.counters.incr("handed_back")
        logger.warning(
            "Claim %s: %s[%s] not run (%s); message handed back to the broker",
            copy.claim_id,
            copy.request.name,
            copy.request.id,
            why,
        )
        self._release_claim(copy, why)
        copy.handed_back = True
        self._on_loop(self._requeue, copy)

    def _requeue(self, copy: Copy) -> None:
        with contextlib.suppress(Exception):
            copy.request.reject(requeue=True)

    def _readmit(self, copy: Copy) -> None:
        """A waiting copy whose claim was taken over (moved to ``RECEIVED`` by :meth:`_lose`):
        out of its lane, through the gate again under a new owner."""
        if copy.state is not State.RECEIVED:
            return
        slot, copy.lane_slot = copy.lane_slot, None
        if self.lanes is not None:
            self.lanes.forget(copy)
            if slot is not None:  # granted, then waiting for its turn
                self.lanes.release(slot)
        self.slots.take_back(copy)
        # a new owner: under its old one the copy would simply re-claim the task
        owner = new_owner(self.hostname)
        copy.owner = owner if copy.key is None else copy.key.owner(owner)
        copy.token = None
        copy.request.request_dict.pop(REQUEST_KEY, None)
        if self._recheck is not None:
            self._recheck(copy)

    def _stop(self, copy: Copy) -> None:
        """Stop a stale running copy: terminate its pool process where that is possible."""
        request = copy.request
        pid = getattr(request, "worker_pid", None)
        pool = self.pool
        # Only a separate process can be stopped: thread and solo pools run the task in this
        # process (worker_pid is ours), where it is fenced instead and its result discarded.
        if pool is None or not pid or pid == os.getpid():
            logger.warning(
                "Claim %s: %s[%s] keeps running fenced; its result will be discarded",
                copy.claim_id,
                request.name,
                request.id,
            )
            return
        # a task that ended meanwhile must not be stopped: its process may already run
        # another task (the same last-moment race Celery's revoke(terminate=True) has)
        if copy.state is not State.STALE or result_ready(request):
            return
        try:
            # SIGKILL: a stale copy must not run its cleanup code either (it may write)
            pool.terminate_job(pid, signal.SIGKILL)
        except Exception as exc:
            logger.warning("Claim %s: could not terminate the stale copy: %r", copy.claim_id, exc)
            return
        self.counters.incr("stale_terminated")
        logger.warning(
            "Claim %s: terminated %s[%s] (pool process %d): another worker owns it now",
            copy.claim_id,
            request.name,
            request.id,
            pid,
        )

    def _on_loop(self, fn: Callable[..., object], *args: Any) -> None:
        """Run a broker call on the consumer's thread."""
        if threading.get_ident() == self._loop_thread or self._consumer is None:
            fn(*args)
        else:
            self.waker.call_soon(self._consumer, fn, *args)


def _skip_detail(record: Any) -> str:
    """What a skipped (or rescheduled) copy met, for the log."""
    if isinstance(record, AlreadyClaimed):
        return f"is held by task {_holder_task_id(record)} ({record.owner})"
    if isinstance(record, AlreadyDone):
        return f"already done by {record.owner} (instance {record.instance})"
    return f"given up as poison after {getattr(record, 'takeovers', '?')} takeovers"


def _holder_task_id(record: Any) -> str | None:
    """The task id a keyed claim's holder (or a record's owner) names, or None."""
    task_key = owner_task_key(str(getattr(record, "owner", "") or ""))
    return None if task_key is None else task_key.rsplit(":", 2)[0]


def _past_limit(copy: Copy, now: float) -> bool:
    """True if a running copy has passed its time limit (its claim is no longer renewed)."""
    return copy.state is State.RUNNING and now >= copy.renew_until


def _quietly(ack: Callable[[], object], copy: Copy) -> None:
    """A deferred ack; a failure is logged (the broker then redelivers the message, whose
    copies are skipped: the completion is recorded)."""
    try:
        ack()
    except Exception as exc:
        logger.warning("Claim %s: recorded done, ack failed: %r", copy.claim_id, exc)
