"""Model check: random operations and clock moves give identical results on Redis and memory.

A hypothesis state machine drives ``RedisClaimManager`` (with a client clock) and the
``MemoryClaimManager`` specification side by side; every answer, error and counter must match.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_claims import ClaimError, ClaimToken, MemoryClaimManager, RedisClaimManager
from celery_claims.testing import ManualClock
from tests.servers import RedisServer

QUEUES = st.sampled_from(["q1", "q:{2}"])
TASKS = st.sampled_from(["a", "b", "c"])
OWNERS = st.sampled_from(["w1", "w2", "w3"])
MS = st.integers(min_value=0, max_value=50)
#: No takeover limit (today's behaviour), or one small enough to be reached.
LIMITS = st.one_of(st.none(), st.integers(min_value=0, max_value=2))
#: Leases that often run out at once, so that takeovers (and give-ups) are frequent.
SHORT_MS = st.sampled_from([0, 0, 1, 10, 50])


def comparable(value: object) -> object:
    """Errors compare by identity; compare them by type and token instead."""
    if isinstance(value, ClaimError):
        return ("error", type(value).__name__, getattr(value, "token", None))
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def outcome(call: Any) -> object:
    """A comparable outcome: the value, or the error's type and token."""
    try:
        return ("ok", comparable(call()))
    except ClaimError as error:
        return comparable(error)


class ClaimsAgreeWithTheSpecification(RuleBasedStateMachine):
    client: redis.Redis

    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock()
        self.spec = MemoryClaimManager(clock=self.clock)
        self.redis = RedisClaimManager(
            client=self.client, prefix=f"mc{uuid.uuid4().hex[:10]}", clock=self.clock
        )
        self.tokens: list[ClaimToken] = []

    def both(self, name: str, *args: Any, **kwargs: Any) -> object:
        expected = outcome(lambda: getattr(self.spec, name)(*args, **kwargs))
        actual = outcome(lambda: getattr(self.redis, name)(*args, **kwargs))
        assert actual == expected, f"{name}{args}: redis {actual} != memory {expected}"
        return expected

    def remember(self, result: object) -> None:
        value = result[1] if isinstance(result, tuple) and result[0] == "ok" else None
        token = getattr(value, "token", None)
        if isinstance(token, ClaimToken):
            self.tokens.append(token)

    @rule(queue=QUEUES, task=TASKS, owner=OWNERS, lease=MS)
    def claim(self, queue: str, task: str, owner: str, lease: int) -> None:
        self.remember(self.both("claim", queue, task, owner, lease))

    @rule(queue=QUEUES, task=TASKS, owner=OWNERS, lease=SHORT_MS, limit=LIMITS, keep=MS)
    def claim_unless_done(
        self, queue: str, task: str, owner: str, lease: int, limit: int | None, keep: int
    ) -> None:
        self.remember(
            self.both(
                "claim_unless_done",
                queue,
                task,
                owner,
                lease,
                max_takeovers=limit,
                given_up_ttl_ms=keep,
            )
        )

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.both("release", data.draw(st.sampled_from(self.tokens)))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), ttl=MS)
    def complete(self, data: st.DataObject, ttl: int) -> None:
        self.both("complete", data.draw(st.sampled_from(self.tokens)), ttl)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mark_started(self, data: st.DataObject) -> None:
        self.both("mark_started", data.draw(st.sampled_from(self.tokens)))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), queue=QUEUES, extra=MS)
    def extend(self, data: st.DataObject, queue: str, extra: int) -> None:
        self.both("extend", queue, data.draw(st.sampled_from(self.tokens)), extra)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), queue=QUEUES, lease=MS)
    def renew(self, data: st.DataObject, queue: str, lease: int) -> None:
        tokens = data.draw(st.lists(st.sampled_from(self.tokens), max_size=3))
        self.both("renew", queue, tokens, lease)

    @rule(queue=QUEUES, task=TASKS, owner=OWNERS)
    def read(self, queue: str, task: str, owner: str) -> None:
        self.both("is_claimed", queue, task)
        self.both("get_token", queue, task, owner)
        self.both("done_record", queue, task)

    @rule(ms=st.integers(min_value=0, max_value=40))
    def tick(self, ms: int) -> None:
        self.clock.advance(ms)

    @rule(limit=st.one_of(st.none(), st.integers(min_value=1, max_value=3)))
    def cleanup(self, limit: int | None) -> None:
        self.both("cleanup_expired", limit=limit)
        if limit is not None:
            # Which expired claims a limited run removes first is not part of the contract
            # (the Redis backend keeps no expiry index: it removes them in its sweep's order,
            # the specification soonest expiry first), so the two may now hold different
            # expired claims: both removed as many, and a run without a limit removes the
            # rest, leaving both with the same claims again.
            self.both("cleanup_expired", limit=None)

    @invariant()
    def listings_and_stats_agree(self) -> None:
        for queue in ("q1", "q:{2}"):
            self.both("list_claims", queue)
            self.both("active_claims", queue)
        self.both("stats")


@pytest.mark.slow
def test_redis_backend_matches_the_memory_specification(redis_server: RedisServer) -> None:
    ClaimsAgreeWithTheSpecification.client = redis_server.client()
    try:
        run_state_machine_as_test(
            ClaimsAgreeWithTheSpecification,
            settings=settings(
                max_examples=150,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        ClaimsAgreeWithTheSpecification.client.close()
