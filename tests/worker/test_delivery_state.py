"""The delivery state machine alone: every state x target, the endings table, no I/O imports.

The expected moves are written out here independently of ``TRANSITIONS`` (from the table in
docs/semantics.md, "The lifecycle of a delivered copy"), so a change to one without the other
fails.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from celery_claims.worker.delivery import state as state_module
from celery_claims.worker.delivery.state import (
    ENDINGS,
    IN_POOL,
    RENEWED,
    TERMINAL,
    TRANSITIONS,
    Ending,
    IllegalMove,
    State,
    move,
)

S = State
#: (from, to) for every legal move, as docs/semantics.md lists them.
EXPECTED = {
    # the gate's outcomes, first time and on each re-check of a held copy
    *((f, t) for f in (S.RECEIVED, S.HELD) for t in (S.HELD, S.WAITING, S.QUEUED, S.SKIPPED)),
    (S.RECEIVED, S.GONE),  # connection closed
    (S.HELD, S.GONE),
    # waiting for a lane slot or a turn: granted, lease lost (back through the gate), closed
    (S.WAITING, S.QUEUED),
    (S.WAITING, S.RECEIVED),
    (S.WAITING, S.RELEASED),
    # in the pool: started, succeeded, ended otherwise, went stale, handed back
    (S.QUEUED, S.RUNNING),
    *(
        (f, t)
        for f in (S.QUEUED, S.RUNNING)
        for t in (S.COMPLETING, S.DONE, S.RELEASED, S.STALE, S.GONE)
    ),
    # a body that returned: recorded, or another copy took the task first
    (S.COMPLETING, S.DONE),
    (S.COMPLETING, S.STALE),
    # a stale copy is let go
    (S.STALE, S.GONE),
}


@pytest.mark.parametrize(("was", "to"), list(itertools.product(State, State)))
def test_a_move_is_allowed_exactly_where_the_table_lists_it(was: State, to: State) -> None:
    if (was, to) in EXPECTED:
        assert move(was, to) is to
        assert to in TRANSITIONS[was]
    else:
        with pytest.raises(IllegalMove) as refused:
            move(was, to, claim_id="q/t:0:0")
        assert refused.value.state is was
        assert refused.value.to is to
        assert f"claim q/t:0:0: illegal move {was} -> {to}" in str(refused.value)


def test_the_table_lists_no_move_the_docs_do_not() -> None:
    listed = {(was, to) for was, targets in TRANSITIONS.items() for to in targets}
    assert listed == EXPECTED


def test_the_ended_states_have_no_way_out_and_every_other_state_reaches_one() -> None:
    assert {S.DONE, S.RELEASED, S.SKIPPED, S.GONE} == TERMINAL
    for start in State:
        seen, todo = {start}, [start]
        while todo:
            for nxt in TRANSITIONS[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert seen & TERMINAL, f"{start} never ends"


def test_only_live_claims_are_renewed_and_the_pool_states_are_among_them() -> None:
    assert RENEWED.isdisjoint(TERMINAL)
    assert S.STALE not in RENEWED  # a stale copy's lease is another copy's business
    assert S.HELD not in RENEWED  # a held copy owns no claim
    assert IN_POOL <= RENEWED


def test_every_ending_is_written_once_and_ends_in_an_ended_state() -> None:
    assert set(ENDINGS) == set(Ending)
    for ending, row in ENDINGS.items():
        assert row.state in TERMINAL, ending
        for effect in (row.broker, row.store, row.journal, row.signals):
            assert effect.strip(), f"{ending}: an effect left unsaid"
    reached = {row.state for row in ENDINGS.values()}
    assert reached == TERMINAL


def test_an_ack_happens_only_in_the_endings_whose_task_is_done_or_durable_elsewhere() -> None:
    # the first safety rule, read off the table: the broker's copy is acked only where the
    # task is recorded done, failed for good, or another durable copy exists
    acked = {e for e, row in ENDINGS.items() if row.broker.startswith(("acked", "published"))}
    assert acked == {Ending.ACK_UNRUN, Ending.RESCHEDULE, Ending.REFUSE, Ending.RECORD_AND_ACK}
    assert "live owner" in ENDINGS[Ending.LET_GO].broker
    assert "requeue" in ENDINGS[Ending.HAND_BACK].broker


def test_the_state_table_imports_neither_celery_kombu_nor_redis() -> None:
    tree = ast.parse(Path(state_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "enum", "dataclasses"}, imported
