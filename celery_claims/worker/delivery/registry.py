"""Every live copy of one worker and its state: the one place a copy's state changes.

Each move is checked against :data:`~.state.TRANSITIONS` (:func:`~.state.move`) under one lock.
A copy that reaches an ended state leaves the registry. The parts of the lifecycle read the
copies from here and move them only through :meth:`Registry.move` and
:meth:`Registry.go_stale`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from celery_claims.worker.delivery.copy import Copy
from celery_claims.worker.delivery.state import (
    IN_POOL,
    RENEWED,
    TRANSITIONS,
    IllegalMove,
    State,
    move,
)

__all__ = ["Registry"]


class Registry:
    """The live copies of one worker, by identity, and their moves."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_id: dict[int, Copy] = {}
        #: told when a taken-over copy leaves the pool (set by the turns)
        self.left_pool: Callable[[], object] = lambda: None

    def add(self, copy: Copy) -> None:
        """A new copy in the gate."""
        with self.lock:
            self.by_id[id(copy)] = copy

    def copies(self, *states: State) -> list[Copy]:
        """The live copies in any of ``states`` (all live copies without arguments)."""
        with self.lock:
            if not states:
                return list(self.by_id.values())
            return [c for c in self.by_id.values() if c.state in states]

    def renewed(self) -> list[Copy]:
        """The copies whose claims the keeper renews (not those past their time limit)."""
        now = time.monotonic()
        with self.lock:
            return [
                c
                for c in self.by_id.values()
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

    def held(self) -> list[Copy]:
        """The copies held unacked now."""
        return self.copies(State.HELD)

    def started_late(self, now: float) -> list[Copy]:
        """The copies queued in the pool past their ``start_by``."""
        return [c for c in self.copies(State.QUEUED) if now > c.start_by]

    def move(self, copy: Copy, to: State, *, only_from: frozenset[State] | None = None) -> bool:
        """Move ``copy`` to ``to``; False (nothing changed) if it is not in ``only_from``.

        Raises:
            IllegalMove: the move is not in :data:`~.state.TRANSITIONS` (a bug).
        """
        with self.lock:
            was = copy.state
            if only_from is not None and was not in only_from:
                return False
            # move()'s check, inline: every message moves four times
            if to not in TRANSITIONS[was]:
                raise IllegalMove(was, to, copy.claim_id)
            copy.state = to
            if not TRANSITIONS[to]:
                self.by_id.pop(id(copy), None)  # ended: it leaves the registry
        if copy.mark_start and was in IN_POOL and to not in IN_POOL:
            self.left_pool()
        return True

    def move_locked(self, copy: Copy, to: State) -> None:
        """:meth:`move` for a caller that holds :attr:`lock` and stays in a live state."""
        try:
            copy.state = move(copy.state, to)
        except IllegalMove:
            raise IllegalMove(copy.state, to, copy.claim_id) from None

    def go_stale(self, copy: Copy, why: str, *, other_owner: bool) -> bool:
        """Move a copy in the pool or completing to ``STALE``; False if it is elsewhere.

        ``other_owner``: another copy owns a live lease on the task (its message may then be
        acked where it has a delivery of its own).
        """
        with self.lock:
            if copy.state not in (State.QUEUED, State.RUNNING, State.COMPLETING):
                return False
            was = copy.state
            try:
                copy.state = move(was, State.STALE)
            except IllegalMove:
                raise IllegalMove(was, State.STALE, copy.claim_id) from None
            copy.stale_why = why
            copy.other_owner = other_owner
        if copy.mark_start and was in IN_POOL:
            self.left_pool()
        return True


def _past_limit(copy: Copy, now: float) -> bool:
    """True if a running copy has passed its time limit (its claim is no longer renewed)."""
    return copy.state is State.RUNNING and now >= copy.renew_until
