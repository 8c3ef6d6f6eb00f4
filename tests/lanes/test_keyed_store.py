"""Keyed lane passes of the Redis store: a per-key limit beside the lane's limit, enforced in the
claim script's one round trip, derived from live leases (nothing kept per key)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from celery_claims.lanes import InvalidValueError, TaskClaimCandidate, TaskLaneConfig
from celery_claims.lanes.redis import RedisTaskClaimStore
from tests.lanes.conftest import T0, redis_dump
from tests.servers import RedisServer, command_calls, on_every_server

pytestmark = on_every_server

TENANTS = TaskLaneConfig(lane="exports", kinds=("exports",), limit=4)
LEASE = T0 + timedelta(seconds=30)
#: The commands the keyed claim script runs inside Redis.
SCRIPT_INTERNAL = {"hget", "hset", "zadd", "zrem", "zcount", "zrangebyscore"}


def _store(store_server: RedisServer, prefix: str, tickets: int) -> RedisTaskClaimStore:
    store = RedisTaskClaimStore(client=store_server.client(), lanes=[TENANTS], prefix=prefix)
    for ticket in range(1, tickets + 1):
        store.enqueue(ticket, "exports", next_run_at=T0 - timedelta(seconds=1))
    return store


def _candidates(*tickets: int) -> list[TaskClaimCandidate]:
    return [TaskClaimCandidate(i, t, 0, 1) for i, t in enumerate(tickets)]


def test_a_key_at_its_limit_is_skipped_and_the_next_key_gets_the_slot(
    store_server: RedisServer, key_prefix: str
) -> None:
    # Given a lane of limit 4 with 1 per key, and five candidates: a, a, b, c, a
    store = _store(store_server, key_prefix, 5)

    # When they are claimed in one pass
    claimed = store.claim_candidates_for_lane(
        TENANTS,
        _candidates(1, 2, 3, 4, 5),
        T0,
        T0,
        LEASE,
        keys=["a", "a", "b", "c", "a"],
        limit_per_key=1,
    )

    # Then the first of each key is claimed and the other a's use no capacity
    assert [c.task_id for c in claimed] == [1, 3, 4]
    # and a later pass finds a still held, while a new key takes the fourth slot
    more = store.claim_candidates_for_lane(
        TENANTS, _candidates(2, 5), T0, T0, LEASE, keys=["a", "d"], limit_per_key=1
    )
    assert [c.task_id for c in more] == [5]


def test_the_lane_limit_still_holds_across_keys(store_server: RedisServer, key_prefix: str) -> None:
    # Given six candidates of six keys, 2 per key allowed, lane limit 4
    store = _store(store_server, key_prefix, 6)

    # When they are claimed
    claimed = store.claim_candidates_for_lane(
        TENANTS, _candidates(*range(1, 7)), T0, T0, LEASE, keys=list("abcdef"), limit_per_key=2
    )

    # Then four are, in the caller's order
    assert [c.task_id for c in claimed] == [1, 2, 3, 4]


def test_an_expired_lease_frees_its_key_slot(store_server: RedisServer, key_prefix: str) -> None:
    # Given key a held by ticket 1 until LEASE (its holder crashed: nobody renews it)
    store = _store(store_server, key_prefix, 2)
    store.claim_candidates_for_lane(
        TENANTS, _candidates(1), T0, T0, LEASE, keys=["a"], limit_per_key=1
    )
    held = store.claim_candidates_for_lane(
        TENANTS, _candidates(2), T0, T0, LEASE, keys=["a"], limit_per_key=1
    )
    assert held == []

    # When another ticket asks for key a after the lease expired
    later = LEASE + timedelta(microseconds=1)
    claimed = store.claim_candidates_for_lane(
        TENANTS,
        _candidates(2),
        later,
        later,
        later + timedelta(seconds=30),
        keys=["a"],
        limit_per_key=1,
    )

    # Then it gets it
    assert [c.task_id for c in claimed] == [2]


def test_a_released_or_completed_slot_leaves_nothing_of_its_key(
    store_server: RedisServer, key_prefix: str
) -> None:
    # Given two keyed slots claimed
    store = _store(store_server, key_prefix, 2)
    store.claim_candidates_for_lane(
        TENANTS,
        _candidates(1, 2),
        T0,
        T0,
        LEASE,
        keys=["tenant-one", "tenant-two"],
        limit_per_key=1,
    )
    assert any(b"tenant-one" in v for v in store.client.hvals(store.lane_keys("exports").tasks))

    # When one is given back (retry, as the worker does) and the other completed
    store.retry(1, 1, next_run_at=T0)
    store.complete(2, 1)

    # Then no key's name is left anywhere under the prefix
    client = store.client
    for key in client.scan_iter(match=f"{key_prefix}:*"):
        values = client.hvals(key) if client.type(key) == b"hash" else client.zrange(key, 0, -1)
        assert not any(b"tenant" in v for v in [key, *values])
    # and the key is free for the next ticket
    again = store.claim_candidates_for_lane(
        TENANTS,
        [TaskClaimCandidate(0, 1, 1, 2)],
        T0,
        T0,
        LEASE,
        keys=["tenant-one"],
        limit_per_key=1,
    )
    assert [c.task_id for c in again] == [1]


def test_a_keyed_pass_is_one_round_trip_of_one_command(store_server: RedisServer) -> None:
    # Given a store whose script is loaded and 50 due tickets
    store = _store(store_server, "keyedonetrip", 50)
    store.claim_candidates_for_lane(TENANTS, [], T0, T0, LEASE)
    lane = TaskLaneConfig("exports", ("exports",), 50)
    observer = store_server.client()
    before = command_calls(observer)

    # When 50 candidates of 10 keys are claimed
    claimed = store.claim_candidates_for_lane(
        lane,
        _candidates(*range(1, 51)),
        T0,
        T0,
        LEASE,
        keys=[f"k{i % 10}" for i in range(50)],
        limit_per_key=3,
    )

    # Then one EVALSHA was sent, and 3 per key were claimed
    after = command_calls(observer)
    delta = {name: after[name] - before.get(name, 0) for name in after}
    delta["info"] -= 1
    assert {n: d for n, d in delta.items() if d and n not in SCRIPT_INTERNAL} == {"evalsha": 1}
    assert len(claimed) == 30
    observer.close()


@pytest.mark.parametrize(
    ("keys", "limit_per_key", "message"),
    [
        (["a"], 1, "1 keys for 2 candidates"),
        (["a", "b"], 0, "limit_per_key must be from 1"),
        (["a", "b"], 5, "limit_per_key must be from 1 to the lane's limit (4)"),
        (None, 1, "limit_per_key needs keys"),
        (["a", ""], 1, "candidate key must be a non-empty str"),
        (["a", 7], 1, "candidate key must be a non-empty str"),
        ("ab", 1, "keys must be a sequence of str"),
        (["a", "x" * 256], 1, "candidate key must be at most 255 characters"),
        (["a", "b"], True, "limit_per_key"),
    ],
)
def test_bad_keys_are_refused_and_change_nothing(
    store_server: RedisServer, key_prefix: str, keys: object, limit_per_key: object, message: str
) -> None:
    # Given two due tickets
    store = _store(store_server, key_prefix, 2)
    before = redis_dump(store.client, key_prefix)

    # When a pass is asked with bad keys, Then it is refused and nothing changed
    with pytest.raises(InvalidValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        store.claim_candidates_for_lane(
            TENANTS,
            _candidates(1, 2),
            T0,
            T0,
            LEASE,
            keys=keys,  # type: ignore[arg-type]  # bad on purpose
            limit_per_key=limit_per_key,  # type: ignore[arg-type]  # bad on purpose
        )
    assert redis_dump(store.client, key_prefix) == before
