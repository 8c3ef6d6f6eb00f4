"""claim_many.lua: several claims and records of a queue in one script call, each answered and
applied exactly as the call alone would be (the consumer's pipe sends them so)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import redis
import redis.exceptions as redis_errors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_claims import (
    AlreadyDone,
    ClaimError,
    ClaimToken,
    InvalidArgument,
    RedisClaimManager,
    Success,
)
from celery_claims.claims.calls import MANY_MAX_CALLS, ScriptCall, many_call
from celery_claims.testing import ManualClock
from tests.contract.conftest import redis_snapshot
from tests.servers import RedisClusterNodes

Q = "q"
TASKS = ("t1", "t2", "t3")
OWNERS = ("w1/10/a.1", "w1/10/a.2", "w2/20/b.1")
LEASE_MS = 1_000
EXAMPLES = itertools.count()  # each example's keys are its own
DONE_TTL_MS = 5_000

#: One call: a claim (task, owner, takeover limit) or the record of an earlier claim's token.
calls = st.one_of(
    st.tuples(
        st.just("claim"),
        st.sampled_from(TASKS),
        st.sampled_from(OWNERS),
        st.sampled_from([None, 1]),
    ),
    st.tuples(st.just("record"), st.integers(0, 20)),
)
#: Rounds of calls, the clock moved on between rounds (ms): expiries, takeovers, given up.
rounds = st.lists(
    st.tuples(st.lists(calls, min_size=1, max_size=6), st.sampled_from([0, 400, 1_200])),
    min_size=1,
    max_size=5,
)


def twins(
    client: redis.Redis, key_prefix: str, clock: ManualClock
) -> tuple[RedisClaimManager, RedisClaimManager]:
    """Two managers on one clock: calls go one by one on the first, together on the second."""
    alone = RedisClaimManager(client=client, prefix=f"{key_prefix}-alone", clock=clock)
    many = RedisClaimManager(client=client, prefix=f"{key_prefix}-many", clock=clock)
    return alone, many


def call_of(manager: RedisClaimManager, op: tuple[Any, ...], tokens: list[ClaimToken]) -> Any:
    if op[0] == "claim":
        _, task, owner, limit = op
        return manager.claim_call(Q, task, owner, LEASE_MS, True, max_takeovers=limit)
    token = tokens[op[1] % len(tokens)]
    return manager.record_call(token, DONE_TTL_MS)


def outcome(call: ScriptCall[Any], reply: Any) -> Any:
    """The call's result, or the type of the error it decodes to."""
    try:
        return call.decode(reply)
    except ClaimError as exc:
        return type(exc)


def alone_outcome(manager: RedisClaimManager, call: ScriptCall[Any]) -> Any:
    try:
        return manager.execute(call)
    except ClaimError as exc:
        return type(exc)


def same_state(alone: RedisClaimManager, many: RedisClaimManager) -> bool:
    def unprefixed(manager: RedisClaimManager) -> dict[bytes, bytes]:
        cut = len(manager.prefix)
        return {key[cut:]: value for key, value in redis_snapshot(manager).items()}

    return unprefixed(alone) == unprefixed(many)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(script=rounds)
def test_calls_together_answer_and_write_what_they_do_one_by_one(
    redis_client: redis.Redis, key_prefix: str, script: list[Any]
) -> None:
    clock = ManualClock()
    alone, many = twins(redis_client, f"{key_prefix}-{next(EXAMPLES)}", clock)
    tokens: list[ClaimToken] = []
    for ops, advance_ms in script:
        usable = [op for op in ops if op[0] == "claim" or tokens]
        if not usable:
            continue
        # Given the same calls on both managers (records of tokens got in earlier rounds)
        one_by_one = [call_of(alone, op, tokens) for op in usable]
        together = [call_of(many, op, tokens) for op in usable]
        # When one manager's go one by one and the other's in one claim_many call
        expected = [alone_outcome(alone, call) for call in one_by_one]
        replies = many.execute(many_call(together))
        got = [outcome(call, reply) for call, reply in zip(together, replies, strict=True)]
        # Then each call got the same answer, and the stores hold the same, byte for byte
        assert got == expected
        assert same_state(alone, many)
        tokens += [result.token for result in got if getattr(result, "token", None)]
        clock.advance(advance_ms)


def test_calls_of_two_queues_or_other_scripts_cannot_go_together(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    manager = RedisClaimManager(client=redis_client, prefix=key_prefix)
    token = manager.claim(Q, "t1", OWNERS[0], LEASE_MS).token
    claim = manager.claim_call(Q, "t2", OWNERS[0], LEASE_MS)
    with pytest.raises(InvalidArgument):
        many_call([claim, manager.claim_call("other", "t2", OWNERS[0], LEASE_MS)])
    with pytest.raises(InvalidArgument):
        many_call([claim, manager.complete_call(token, DONE_TTL_MS)])
    with pytest.raises(InvalidArgument):
        many_call([])
    with pytest.raises(InvalidArgument):
        many_call([claim] * (MANY_MAX_CALLS + 1))
    assert manager.is_claimed(Q, "t2") is None


def test_a_malformed_call_is_refused_before_anything_is_written(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    manager = RedisClaimManager(client=redis_client, prefix=key_prefix)
    claim = manager.claim_call(Q, "t1", OWNERS[0], LEASE_MS)
    assert claim.many is not None
    before = redis_snapshot(manager)
    script = manager.scripts["claim_many"]
    part = [claim.many.op, *claim.args]  # the call's part of a claim_many call's ARGV
    for args in ([*part, "x"], [*part, *part[:-1]]):
        with pytest.raises(redis_errors.ResponseError, match="claim_many"):
            script(keys=claim.many.keys, args=args)
    assert redis_snapshot(manager) == before


def test_calls_of_a_queue_go_together_on_a_redis_cluster(
    redis_cluster: RedisClusterNodes, key_prefix: str
) -> None:
    # every key of a queue is in the queue's slot: one node runs the whole call
    client = redis_cluster.client()
    try:
        manager = RedisClaimManager(client=client, prefix=key_prefix)
        token = manager.claim(Q, "t1", OWNERS[0], LEASE_MS).token
        calls = [
            manager.record_call(token, DONE_TTL_MS),
            manager.claim_call(Q, "t1", OWNERS[2], LEASE_MS),
            manager.claim_call(Q, "t2", OWNERS[2], LEASE_MS),
        ]
        replies = manager.execute(many_call(calls))
        got = [outcome(call, reply) for call, reply in zip(calls, replies, strict=True)]
        assert [type(result) for result in got] == [bool, AlreadyDone, Success]
    finally:
        client.close()
