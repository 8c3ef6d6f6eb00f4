"""Taken-over copies take turns in the pool: one at a time, so a task that kills its worker
takes no other task down with it (:meth:`Turns.in_turn`)."""

from __future__ import annotations

import collections
import contextlib
import time

from celery.utils.log import get_logger

from celery_claims.worker.delivery.ack_on_claim import AckOnClaim
from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.registry import Registry
from celery_claims.worker.delivery.state import IN_POOL, State
from celery_claims.worker.delivery.wiring import Wiring

__all__ = ["Turns"]

logger = get_logger("celery_claims.worker")


class Turns:
    """The pool hand-off of claimed copies, and the queue of taken-over ones waiting a turn."""

    def __init__(self, w: Wiring, reg: Registry, acks: AckOnClaim) -> None:
        self.w = w
        self.reg = reg
        self.acks = acks
        #: taken-over copies waiting for their turn: one at a time in the pool (in_turn)
        self.suspects: collections.deque[Copy] = collections.deque()
        reg.left_pool = self.turn_over

    def in_turn(self, copy: Copy) -> None:
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
            with self.reg.lock:
                busy = any(
                    c is not copy and c.mark_start and c.state in IN_POOL
                    for c in self.reg.by_id.values()
                )
                if busy:
                    # WAITING and in the queue of turns at once: _next_turn never sees one
                    # without the other
                    if copy.state is not State.WAITING:
                        self.reg.move_locked(copy, State.WAITING)
                    self.suspects.append(copy)
            if busy:
                self.acks.take(copy)  # it waits outside the pool: acked now, when asked
                logger.info(
                    "Claim %s: taken over; waits for this worker's other taken-over task to "
                    "end (one at a time, so a task that kills its worker takes no other down)",
                    copy.claim_id,
                )
                return
        self.to_pool(copy)

    def turn_over(self) -> None:
        """A taken-over copy left the pool: the next one's turn (on the event loop)."""
        if self.suspects:
            self.w.on_loop(self._next_turn)

    def _next_turn(self) -> None:
        with self.reg.lock:
            if any(c.mark_start and c.state in IN_POOL for c in self.reg.by_id.values()):
                return
            turn = None
            while self.suspects and turn is None:
                waiting = self.suspects.popleft()
                if waiting.state is State.WAITING:
                    turn = waiting
        if turn is not None:
            self.to_pool(turn)

    def out_of_turn(self, copy: Copy) -> None:
        """A copy waiting for its turn leaves ``WAITING`` otherwise (lost, released)."""
        with self.reg.lock, contextlib.suppress(ValueError):
            self.suspects.remove(copy)

    def to_pool(self, copy: Copy) -> None:
        """Hand a claimed copy to the pool (``QUEUED``): it must start by ``start_by``."""
        self.reg.move(copy, State.QUEUED)
        copy.start_by = time.monotonic() + self.w.settings.start_timeout_ms / 1000
        assert self.w.dispatch is not None
        self.w.dispatch(copy)
