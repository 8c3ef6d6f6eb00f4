"""The takeover limit on Redis: one script per claim, and the record formats in the store."""

from __future__ import annotations

import re

import redis

from celery_claims import AlreadyDone, GivenUp, RedisClaimManager, Success, TookOver
from celery_claims.testing import ManualClock
from tests.redis.test_redis_backend import CountingConnection
from tests.servers import RedisServer

Q = "emails"
LEASE = 1_000

#: The completion record format every earlier release reads: instance:done_at:until:owner.
OLD_RECORD = re.compile(r"^(\d+):(\d+):(\d+):(.*)$")


def test_counting_and_giving_up_are_each_one_round_trip(redis_server: RedisServer) -> None:
    # Given a manager whose connection counts the requests it sends, scripts loaded
    pool = redis.ConnectionPool(
        host="127.0.0.1", port=redis_server.port, connection_class=CountingConnection
    )
    clock = ManualClock()
    manager = RedisClaimManager(
        client=redis.Redis(connection_pool=pool), prefix="rtt-t", clock=clock
    )
    warm_up = manager.claim_unless_done(Q, "warm-up", "w", LEASE, max_takeovers=0)
    assert warm_up.token is not None
    manager.mark_started(warm_up.token)
    CountingConnection.sent = 0

    # When a task is claimed, taken over (counted) by a holder that starts it, and given up
    results = []
    for owner in ("w1", "w2", "w3"):
        results.append(manager.claim_unless_done(Q, "poison", owner, LEASE, max_takeovers=1))
        if isinstance(results[-1], TookOver):
            manager.mark_started(results[-1].token)
        clock.advance(LEASE)

    # Then each claim, and the start mark, was one request, whatever it decided
    assert [type(r) for r in results] == [Success, TookOver, GivenUp]
    assert CountingConnection.sent == 4


def test_a_completion_record_of_an_earlier_release_still_parses(
    redis_client: redis.Redis,
) -> None:
    # Given a record written in the format earlier releases wrote, by an owner with a ':'
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    until = clock() + 60_000
    redis_client.hset(manager.keys(Q).done, "t1", f"5:{clock() - 10}:{until}:host:1/42/n")

    # When it is read and a copy of the task asks for the claim
    record = manager.done_record(Q, "t1")
    answer = manager.claim_unless_done(Q, "t1", "w2", LEASE, max_takeovers=0)

    # Then both read it as done, by that owner, at that instance and time
    assert record == answer == AlreadyDone(owner="host:1/42/n", instance=5, done_at=clock() - 10)


def test_a_given_up_record_of_an_earlier_release_still_reads_as_given_up(
    redis_client: redis.Redis,
) -> None:
    # Given a given-up record in the format earlier releases wrote, by an owner with a ':'
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    until = clock() + 60_000
    raw = f"0:{clock() - 10}:{until}:3:host:1/7/a"
    assert OLD_RECORD.match(raw)
    redis_client.hset(manager.keys(Q).done, "poison", raw)

    # When it is read and a copy of the task asks for the claim
    record = manager.done_record(Q, "poison")
    answer = manager.claim_unless_done(Q, "poison", "host:2/8/b", LEASE, max_takeovers=3)

    # Then both read it as given up, after 3 takeovers, by that owner
    assert (
        record
        == answer
        == GivenUp(previous_owner="host:1/7/a", takeovers=3, given_up_at=clock() - 10)
    )


def test_claim_call_carries_the_takeover_limit(redis_client: redis.Redis) -> None:
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    manager.claim(Q, "poison", "w1", LEASE)
    clock.advance(LEASE)

    call = manager.claim_call(Q, "poison", "w2", LEASE, max_takeovers=0, given_up_ttl_ms=5)

    assert manager.execute(call) == GivenUp(previous_owner="w1", takeovers=0, given_up_at=clock())
    clock.advance(5)
    assert manager.done_record(Q, "poison") is None
