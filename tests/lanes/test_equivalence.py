"""Random operation sequences: every store answers exactly as the memory store, the specification.

A Hypothesis state machine drives the memory store and one other store with the same
enqueues, claim batches, completions, retries, heartbeats, listings and clock moves, and checks
after every step that both gave the same result (or the same error type) and hold the same tasks.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from sqlalchemy.pool import StaticPool

from celery_claims.lanes import (
    MemoryTaskClaimStore,
    TaskClaimCandidate,
    TaskLaneConfig,
    claim_due_for_lane,
)
from celery_claims.lanes.redis import RedisTaskClaimStore
from celery_claims.lanes.sql import SqlTaskClaimStore
from tests.lanes.conftest import LANES, T0, Postgres, lane_of
from tests.servers import RedisServer

IDS = st.integers(min_value=0, max_value=6)
TOKENS = st.integers(min_value=0, max_value=3)
KINDS = st.sampled_from(["send_email", "send_sms", "render"])
LANE_CHOICES = st.sampled_from(LANES)
SECONDS = st.integers(min_value=-2, max_value=4)


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """A call's result, or the name of the error it raised."""
    try:
        return ("ok", call())
    except Exception as exc:  # any error type is part of the compared outcome
        return ("error", type(exc).__name__)


class SameAsMemory(RuleBasedStateMachine):
    """Drive the memory store and ``make_other()`` in lockstep."""

    #: Builds the store compared with the memory store; each test sets it on a subclass.
    make_other: Callable[[], Any] = staticmethod(lambda: None)
    #: Lets go of what ``make_other()`` opened, once the example ends.
    close_other: Callable[[Any], None] = staticmethod(lambda other: None)

    def __init__(self) -> None:
        super().__init__()
        self.memory: MemoryTaskClaimStore[str, str] = MemoryTaskClaimStore(lanes=LANES)
        self.other = type(self).make_other()
        self.now = T0

    def both(self, call: Callable[[Any], Any]) -> Any:
        expected = outcome(lambda: call(self.memory))
        actual = outcome(lambda: call(self.other))
        assert actual == expected
        return expected

    @rule(
        task_id=IDS, kind=KINDS, due_secs=st.integers(-3, 1), payload=st.sampled_from(["", "p/ü"])
    )
    def enqueue(self, task_id: int, kind: str, due_secs: int, payload: str) -> None:
        due = self.now + timedelta(seconds=due_secs)
        self.both(lambda s: s.enqueue(task_id, kind, next_run_at=due, payload=payload))

    def draw_token(self, data: st.DataObject, token: int) -> int:
        # Mostly the current token (a live attempt), sometimes a stale or a future one.
        return data.draw(st.sampled_from([token, token, token, token + 1, max(token - 1, 0)]))

    @rule(
        data=st.data(),
        lane=LANE_CHOICES,
        limit=st.integers(min_value=1, max_value=3),
        lease_secs=st.integers(min_value=1, max_value=4),
    )
    def claim(
        self, data: st.DataObject, lane: TaskLaneConfig[str, str], limit: int, lease_secs: int
    ) -> None:
        config = TaskLaneConfig(lane.lane, lane.kinds, limit)
        tasks = [task for task in self.memory.snapshot() if task.kind in lane.kinds]
        batch = data.draw(st.lists(st.sampled_from(tasks), max_size=5)) if tasks else []
        candidates = [
            TaskClaimCandidate(i, t.id, token, token + 1)
            for i, t in enumerate(batch)
            for token in [self.draw_token(data, t.processing_token)]
        ]
        lease = self.now + timedelta(seconds=lease_secs)
        self.both(
            lambda s: s.claim_candidates_for_lane(config, candidates, self.now, self.now, lease)
        )

    @rule(
        lane=LANE_CHOICES,
        limit=st.integers(min_value=0, max_value=3),
        batch=st.lists(st.tuples(IDS, TOKENS), max_size=3),
    )
    def claim_anything(
        self, lane: TaskLaneConfig[str, str], limit: int, batch: list[tuple[int, int]]
    ) -> None:
        config = TaskLaneConfig(lane.lane, lane.kinds, limit)
        candidates = [TaskClaimCandidate(i, t, tok, tok + 1) for i, (t, tok) in enumerate(batch)]
        lease = self.now + timedelta(seconds=1)
        self.both(
            lambda s: s.claim_candidates_for_lane(config, candidates, self.now, self.now, lease)
        )

    @rule(lane=LANE_CHOICES, limit=st.integers(min_value=0, max_value=3), stale=SECONDS)
    def dispatch(self, lane: TaskLaneConfig[str, str], limit: int, stale: int) -> None:
        config = TaskLaneConfig(lane.lane, lane.kinds, limit)
        at = self.now
        self.both(lambda s: claim_due_for_lane(s, config, max(stale, 0), lane_of, clock=lambda: at))

    def pick(self, data: st.DataObject) -> tuple[int, int]:
        """A task id and a token: mostly an existing task and its current token."""
        tasks = self.memory.snapshot()
        if not tasks or data.draw(st.integers(0, 9)) == 0:
            return data.draw(IDS), data.draw(TOKENS)
        task = data.draw(st.sampled_from(tasks))
        return task.id, self.draw_token(data, task.processing_token)

    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        task_id, token = self.pick(data)
        self.both(lambda s: s.complete(task_id, token))

    @rule(data=st.data(), due_secs=SECONDS)
    def retry(self, data: st.DataObject, due_secs: int) -> None:
        task_id, token = self.pick(data)
        due = self.now + timedelta(seconds=due_secs)
        self.both(lambda s: s.retry(task_id, token, next_run_at=due))

    @rule(data=st.data(), lease_secs=SECONDS)
    def heartbeat(self, data: st.DataObject, lease_secs: int) -> None:
        task_id, token = self.pick(data)
        lease = self.now + timedelta(seconds=lease_secs)
        self.both(lambda s: s.heartbeat(task_id, token, lease_expires_at=lease))

    @rule(
        kinds=st.lists(KINDS, min_size=1, max_size=3, unique=True),
        limit=st.integers(min_value=0, max_value=8),
    )
    def listing_and_count(self, kinds: list[str], limit: int) -> None:
        self.both(lambda s: s.list_claimable_by_kinds(self.now, self.now, kinds, limit))
        self.both(lambda s: s.count_active_processing_by_kinds(self.now, kinds))
        self.both(lambda s: s.count_unfinished(kinds))

    @rule(secs=st.integers(min_value=0, max_value=3))
    def advance(self, secs: int) -> None:
        self.now += timedelta(seconds=secs)

    @invariant()
    def same_tasks(self) -> None:
        for task_id in range(7):
            assert self.other.get_task(task_id) == self.memory.get_task(task_id)

    def teardown(self) -> None:
        type(self).close_other(self.other)


SETTINGS = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def run_against(
    make_other: Callable[[], Any],
    max_examples: int = 100,
    close_other: Callable[[Any], None] = lambda other: None,
) -> None:
    machine = type(
        "Machine",
        (SameAsMemory,),
        {"make_other": staticmethod(make_other), "close_other": staticmethod(close_other)},
    )
    run_state_machine_as_test(
        machine,
        settings=settings(SETTINGS, max_examples=max_examples),
    )


def test_redis_store_answers_as_the_memory_store(redis_server: RedisServer) -> None:
    client = redis_server.client()
    try:
        run_against(
            lambda: RedisTaskClaimStore(
                client=client, lanes=LANES, prefix=f"eq{uuid.uuid4().hex[:10]}"
            )
        )
    finally:
        client.close()


def test_sqlite_store_answers_as_the_memory_store() -> None:
    def make() -> SqlTaskClaimStore:
        engine = sa.create_engine(
            "sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False}
        )
        store = SqlTaskClaimStore(engine=engine, lanes=LANES)
        store.create_tables()
        return store

    # Each example's engine holds its in-memory database's one connection (StaticPool): the
    # store does not dispose of an engine it was given, so the example does. Left to the
    # garbage collector, every connection is reported unclosed (a ResourceWarning on 3.13).
    run_against(make, close_other=lambda store: store.engine.dispose())


@pytest.mark.postgres
def test_postgres_store_answers_as_the_memory_store(postgres: Postgres) -> None:
    prefixes: list[str] = []

    def make() -> SqlTaskClaimStore:
        prefixes.append(f"eq{uuid.uuid4().hex[:10]}_")
        store = SqlTaskClaimStore(
            engine=postgres.engine, lanes=LANES, table_prefix=prefixes[-1], schema=postgres.schema
        )
        store.create_tables()
        return store

    try:
        # Fewer examples: each one creates two tables in PostgreSQL.
        run_against(make, max_examples=25)
    finally:
        for prefix in prefixes:
            SqlTaskClaimStore(
                engine=postgres.engine, lanes=LANES, table_prefix=prefix, schema=postgres.schema
            ).drop_tables()
