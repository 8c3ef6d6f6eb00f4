"""The states of a delivered copy and the legal moves between them: a table and pure functions.

Nothing here imports Celery, kombu or Redis, and nothing here has an effect: :func:`move` says
whether a move is legal, :data:`ENDINGS` says what each way out of the pool does to the
broker's copy of the message, the claim store, the publish journal and the signals. The
lifecycle (:mod:`.lifecycle`) is the one caller that changes a copy's state, under its lock,
and carries out those effects. docs/semantics.md, "The lifecycle of a delivered copy", draws
the same table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "ENDINGS",
    "IN_POOL",
    "RENEWED",
    "TERMINAL",
    "TRANSITIONS",
    "Ending",
    "EndingRow",
    "IllegalMove",
    "State",
    "move",
]


class State(enum.Enum):
    """Where a delivered copy is in its lifecycle."""

    #: in the gate, its claim asked for
    RECEIVED = "received"
    #: kept unacked and re-checked on a timer (another copy's live lease, or the store is down)
    HELD = "held"
    #: claimed, waiting for its fleet-wide rate, a slot of its lane, or its turn
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

    # Members are singletons, equal only to themselves: hashed by identity in C, not by
    # Enum's Python-level hash(self._name_), which every `state in IN_POOL` and every
    # TRANSITIONS lookup paid for (about 19 Python calls a message).
    __hash__ = object.__hash__


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


#: States a copy never leaves.
TERMINAL = frozenset(state for state, allowed in TRANSITIONS.items() if not allowed)

#: A copy in the pool: taken-over copies take turns there (``Lifecycle._in_turn``).
IN_POOL = frozenset({State.QUEUED, State.RUNNING})

#: States whose claim the keeper renews.
RENEWED = frozenset({State.WAITING, State.QUEUED, State.RUNNING, State.COMPLETING})


class IllegalMove(AssertionError):
    """A move that :data:`TRANSITIONS` does not list: a bug in the worker layer, never input.

    An ``AssertionError``: code that tolerates a copy having moved on meanwhile (the
    connection loss's drop of held copies) suppresses it as it did the assertion before.
    """

    def __init__(self, state: State, to: State, claim_id: str = "") -> None:
        where = f"claim {claim_id}: " if claim_id else ""
        super().__init__(f"{where}illegal move {state} -> {to}")
        self.state = state
        self.to = to
        self.claim_id = claim_id


def move(state: State, to: State, *, claim_id: str = "") -> State:
    """The state after moving from ``state`` to ``to``: ``to`` where the table allows it.

    Raises:
        IllegalMove: ``to`` is not in ``TRANSITIONS[state]``.
    """
    if to not in TRANSITIONS[state]:
        raise IllegalMove(state, to, claim_id)
    return to


class Ending(enum.Enum):
    """The ways a copy ends; each is one row of :data:`ENDINGS`, carried out in one place."""

    #: the task is recorded done (or given up, or its key is another task's; or, acked at
    #: claim, another copy's live lease and its journal entry keep it): acked unrun
    ACK_UNRUN = "ack_unrun"
    #: a keyed copy whose key is held: published again with a countdown, then acked unrun
    RESCHEDULE = "reschedule"
    #: a keyed copy whose key cannot be made: recorded as failed, then acked unrun
    REFUSE = "refuse"
    #: the body ran and succeeded (or retried, or was replaced): recorded done, then acked
    RECORD_AND_ACK = "record_and_ack"
    #: the attempt ended without success: the claim released, Celery's handler decides
    RELEASE = "release"
    #: another copy owns the task: nothing recorded, the message let go
    LET_GO = "let_go"
    #: not run and not verifiable, or not started in time: back to the broker
    HAND_BACK = "hand_back"
    #: the consumer's connection closed before the copy reached the pool: forgotten
    DROP = "drop"


@dataclass(frozen=True)
class EndingRow:
    """What one ending does, in the order it does it.

    Attributes:
        state: the state the copy ends in.
        broker: what happens to the broker's copy of the message.
        store: what happens in the claim store.
        journal: what happens to the message's publish journal entry.
        signals: what Celery and this package are told.
    """

    state: State
    broker: str
    store: str
    journal: str
    signals: str


#: Every ending, written once (docs/semantics.md draws the same table). The journal entry is
#: always cleared before the ack: a worker killed between the two leaves the message for the
#: broker to deliver again, where the other order would leave journal recovery an acked
#: message to publish again.
ENDINGS: dict[Ending, EndingRow] = {
    Ending.ACK_UNRUN: EndingRow(
        state=State.SKIPPED,
        broker="acked (the task is recorded done, or, acknowledged at claim, another copy's "
        "live lease and its journal entry are its durable copy: this copy is not the durable "
        "one)",
        store="nothing (the record or claim it met stays); a key's unrun task id: REVOKED result",
        journal="cleared before the ack (kept as not done for a key held by another task; "
        "kept for a task claimed by a live lease: the entry is its durable copy)",
        signals="task_ready, task_skipped(reason)",
    ),
    Ending.RESCHEDULE: EndingRow(
        state=State.SKIPPED,
        broker="published again with a countdown, then acked (the new message is durable)",
        store="nothing",
        journal="kept: the new message is journaled as it is published",
        signals="task_ready, task_skipped('key_rescheduled')",
    ),
    Ending.REFUSE: EndingRow(
        state=State.SKIPPED,
        broker="acked once the failure is stored; left unacked if it cannot be",
        store="never claimed",
        journal="cleared before the ack",
        signals="FAILURE result, task_failure, task-failed, task_ready, "
        "task_skipped('key_refused')",
    ),
    Ending.RECORD_AND_ACK: EndingRow(
        state=State.DONE,
        broker="acked by Celery's handler once the record is written (or in one script "
        "with it, on the Redis broker)",
        store="completion recorded",
        journal="cleared as done",
        signals="Celery's own (task_ready, task_success)",
    ),
    Ending.RELEASE: EndingRow(
        state=State.RELEASED,
        broker="Celery's handler: acked, rejected or requeued by Celery's rules",
        store="claim released",
        journal="cleared just before the handler's ack or reject (kept if it requeues)",
        signals="Celery's own, claim_released",
    ),
    Ending.LET_GO: EndingRow(
        state=State.GONE,
        broker="Redis broker: forgotten in this worker only (its record in unacked is the "
        "live owner's too); other brokers: acked where another copy owns a live lease, "
        "handed back otherwise",
        store="nothing (another copy's claim or record)",
        journal="kept (the task is not done by this copy)",
        signals="task_ready (and lease_lost when the lease was lost)",
    ),
    Ending.HAND_BACK: EndingRow(
        state=State.GONE,
        broker="rejected with requeue: the broker delivers it again",
        store="claim released",
        journal="kept",
        signals="task_ready",
    ),
    Ending.DROP: EndingRow(
        state=State.GONE,
        broker="nothing: the closed channel's unacked messages are redelivered",
        store="nothing (it held no claim of its own)",
        journal="kept",
        signals="none",
    ),
}
