"""One delivered copy of a task message (:class:`Copy`): what the lifecycle knows of it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_claims.model import ClaimToken
from celery_claims.rates import Limit
from celery_claims.worker.delivery.keyed import KeyedClaim
from celery_claims.worker.delivery.lane_model import LaneSlot
from celery_claims.worker.delivery.state import State
from celery_claims.worker.transport.broker import Delivery

__all__ = ["Copy"]


@dataclass(eq=False, init=False)
class Copy:
    """One delivered copy of a task message, from the gate until it ends.

    Made once per message: its ``__init__`` sets what the gate knows of it, every other field
    reads its default from the class until it is first set (a dataclass's own ``__init__``
    set all thirty).

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
        hold_reason: ``"held"`` or ``"unavailable"`` while held; ``"rate"`` while it waits
            for its rate, once reported (``rates.py``).
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
        rate_limits: the fleet-wide rates its start must pass (its task's, its lane's), made
            in the gate before its claim (``rates.py``).
        mark_start: its claim was granted by a takeover under ``claims_max_takeovers``: its
            start is marked in the store (by its pool process, ``guard.py``; by this process
            for an unguarded task), so that it counts toward the limit only once started.
        pool_settles: the process that runs its body records the completion and removes
            the delivery from kombu's unacked set in one script, before it reports success
            (:meth:`Lifecycle.pool_settle`): Celery's ack then costs no round trip.
        acked_at_claim: its message was acknowledged once its claim was taken
            (``claims_ack_on_claim``): nothing of it is left in the broker, its publish journal
            entry is its durable copy (``ack_on_claim.py``).
        run: the run its message carries, for a canvas part (``publish/runs.py``): its
            owner names it, and its claims are asked with it (kept here, not parsed back out
            of the owner for each claim).
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
    rate_limits: tuple[Limit, ...] = ()
    mark_start: bool = False
    pool_settles: bool = False
    acked_at_claim: bool = False
    run: int | None = None

    def __init__(
        self,
        request: Any,
        owner: str,
        queue_id: str,
        task_key: str,
        lease_ms: int,
        guarded: bool,
        delivery: Delivery | None = None,
        key: KeyedClaim | None = None,
        lane_key: str = "",
        run: int | None = None,
        **others: Any,
    ) -> None:
        self.request = request
        self.owner = owner
        self.queue_id = queue_id
        self.task_key = task_key
        self.lease_ms = lease_ms
        self.guarded = guarded
        self.delivery = delivery
        self.key = key
        self.lane_key = lane_key
        self.run = run
        for name, value in others.items():
            if name not in _FIELDS:
                raise TypeError(f"Copy() got an unexpected keyword argument {name!r}")
            setattr(self, name, value)

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


#: The fields :class:`Copy` takes as keywords.
_FIELDS = frozenset(Copy.__dataclass_fields__)
