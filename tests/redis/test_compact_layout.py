"""The compact claim layout: bytes per claim and record, interned owners, the sweeping cleanup,
and the entries and records an earlier release wrote."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_claims import AlreadyClaimed, RedisClaimManager, Success
from celery_claims.claims.redis import CLEANUP_BATCH, SWEEP_PER_LIMIT
from celery_claims.testing import ManualClock
from celery_claims.worker.identity import new_owner
from tests.servers import RedisServer

Q = "emails"
LEASE = 60_000
#: The issue's target: Redis memory per live claim and per completion record.
MOST_BYTES_PER_ENTRY = 150


@pytest.fixture
def fresh_redis() -> Iterator[redis.Redis]:
    """A Redis of its own, so that ``used_memory`` counts this test's keys only."""
    server = RedisServer().start()
    try:
        yield server.client()
    finally:
        server.cleanup()


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def heads(client: redis.Redis, manager: RedisClaimManager) -> list[str]:
    """The owner heads the queue's owners hash holds."""
    fields = client.hkeys(manager.keys(Q).owners)
    return sorted(f.decode()[1:] for f in fields if f.startswith(b"h"))


def test_a_live_claim_and_a_completion_record_each_cost_at_most_150_bytes(
    fresh_redis: redis.Redis,
) -> None:
    # Given 20,000 tasks named as the worker names them (36-character Celery ids plus the
    # attempt), claimed by one worker process's deliveries
    tasks = 20_000
    manager = RedisClaimManager(client=fresh_redis)
    manager.claim("warm", "warm", "w", 1)  # scripts loaded, queue set written
    ids = [f"{uuid.uuid4()}:0:0" for _ in range(tasks)]
    before = used_memory(fresh_redis)

    # When they are all claimed, and then all completed with a 24 h retention
    calls = [manager.claim_call(Q, i, new_owner("celery@host-1"), LEASE) for i in ids]
    tokens = [r.token for r in manager.execute_many(calls)]
    claimed = used_memory(fresh_redis)
    manager.execute_many([manager.complete_call(t, 86_400_000) for t in tokens if t])
    completed = used_memory(fresh_redis)

    # Then each live claim, and each completion record once the claims are gone, costs at
    # most 150 bytes of Redis memory (the earlier layout took 331)
    assert manager.active_claims(Q) == 0
    assert fresh_redis.hlen(manager.keys(Q).done) == tasks
    assert (claimed - before) / tasks <= MOST_BYTES_PER_ENTRY
    assert (completed - before) / tasks <= MOST_BYTES_PER_ENTRY


def test_a_worker_process_head_is_written_once_and_goes_with_its_last_entry(
    redis_client: redis.Redis,
) -> None:
    # Given three deliveries of one worker process, and one of another process
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    mine = [new_owner("celery@host-1") for _ in range(3)]
    tokens = [manager.claim(Q, f"t{i}", owner, LEASE).token for i, owner in enumerate(mine)]
    other = manager.claim(Q, "t9", "celery@host-2/77/abcdef01.0", LEASE).token
    assert None not in tokens
    assert other is not None

    # Then each process's head is stored once, and each owner reads back whole
    assert heads(redis_client, manager) == sorted(
        [mine[0].rsplit(".", 1)[0] + ".", "celery@host-2/77/abcdef01."]
    )
    assert [t.owner for t in manager.list_claims(Q) if t.task_id != "t9"] == mine

    # When the first process's claims complete, and their records and the other claim go
    for token in tokens:
        assert token is not None
        manager.complete(token, 1_000)
    manager.release(other)
    assert heads(redis_client, manager) == [mine[0].rsplit(".", 1)[0] + "."]
    clock.advance(1_000)
    manager.cleanup_expired()

    # Then no head is left behind: nothing names them any more
    assert heads(redis_client, manager) == []
    assert redis_client.hlen(manager.keys(Q).done) == 0


def test_a_head_stays_while_a_takeover_leaves_a_record_naming_it(
    redis_client: redis.Redis,
) -> None:
    # Given a claim of one process taken over by another, which then completes
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    manager.claim(Q, "t1", "host-1/1/aa.1", LEASE)
    clock.advance(LEASE)
    took = manager.claim_unless_done(Q, "t1", "host-2/2/bb.1", LEASE, max_takeovers=5)
    assert took.token is not None

    # Then the first process's head went with its entry
    assert heads(redis_client, manager) == ["host-2/2/bb."]
    stored = manager.read(Q, ["t1"])[0]
    assert stored.takeovers == 1
    assert stored.claim == took.token

    # And the second one's passes to its completion record, read back whole
    manager.complete(took.token, 5_000)
    assert heads(redis_client, manager) == ["host-2/2/bb."]
    record = manager.done_record(Q, "t1")
    assert record is not None
    assert record.owner == "host-2/2/bb.1"


def test_a_record_past_its_retention_replaced_by_a_new_completion_gives_back_its_head(
    redis_client: redis.Redis,
) -> None:
    # Given a task completed by one process, its record past its retention but not purged
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    first = manager.claim_unless_done(Q, "t1", "host-1/1/aa.1", LEASE).token
    assert first is not None
    manager.complete(first, 1_000)
    clock.advance(1_000)

    # When another process claims it again and completes it
    second = manager.claim_unless_done(Q, "t1", "host-2/2/bb.1", LEASE).token
    assert second is not None
    manager.complete(second, 5_000)

    # Then the new record replaced the old one, whose head went with it
    record = manager.done_record(Q, "t1")
    assert record is not None
    assert (record.instance, record.owner) == (second.instance, "host-2/2/bb.1")
    assert heads(redis_client, manager) == ["host-2/2/bb."]
    assert redis_client.hlen(manager.keys(Q).done) == 1


def test_a_record_of_an_earlier_release_is_replaced_by_a_new_completion(
    redis_client: redis.Redis,
) -> None:
    # Given a record as an earlier release wrote it (decimal, whole owner), past its retention
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    now = clock()
    redis_client.hset(manager.keys(Q).done, "t1", f"3:{now - 20}:{now - 10}:host-1/1/aa.1")

    # When a worker claims the task and completes it
    token = manager.claim_unless_done(Q, "t1", "host-2/2/bb.1", LEASE).token
    assert token is not None
    manager.complete(token, 5_000)

    # Then its record is the new one, in the compact format, and only its head is interned
    record = manager.done_record(Q, "t1")
    assert record is not None
    assert (record.instance, record.owner) == (token.instance, "host-2/2/bb.1")
    assert heads(redis_client, manager) == ["host-2/2/bb."]
    assert b":" not in (redis_client.hget(manager.keys(Q).done, "t1") or b":")


def test_a_claim_entry_of_an_earlier_release_is_honoured_and_cleaned_up(
    redis_client: redis.Redis,
) -> None:
    # Given a live claim and an expired one as an earlier release wrote them (decimal, whole
    # owner, and its expiry sorted set and takeover counts)
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    keys = manager.keys(Q)
    now = clock()
    redis_client.hset(keys.claims, "live", f"5:{now - 10}:{now + LEASE}:host:1/42/n.3")
    redis_client.hset(keys.claims, "old", f"4:{now - 20}:{now - 1}:host:1/42/n.2")
    redis_client.zadd(f"{keys.tag}:e", {"live": now + LEASE, "old": now - 1})
    redis_client.hset(f"{keys.tag}:t", "live", 1)
    manager.claim("other", "x", "w", 1)  # the queue set holds Q after the first claim anyway
    redis_client.sadd(f"{manager.prefix}:queues", Q)

    # When another worker asks for the live one, and its holder then completes it
    refused = manager.claim(Q, "live", "host:2/9/m.1", LEASE)
    listed = manager.list_claims(Q)
    token = manager.get_token(Q, "live", "host:1/42/n.3")
    assert token is not None
    manager.complete(token, 10_000)

    # Then it was held by its holder, listed, and completed into a compact record
    assert refused == AlreadyClaimed(owner="host:1/42/n.3", expires_at=now + LEASE)
    assert [(t.task_id, t.instance, t.owner) for t in listed] == [("live", 5, "host:1/42/n.3")]
    record = manager.done_record(Q, "live")
    assert record is not None
    assert (record.instance, record.owner) == (5, "host:1/42/n.3")
    raw = redis_client.hget(keys.done, "live")
    assert raw is not None
    assert raw.startswith(b"5,")  # instance 5 in base 36, then the compact fields

    # And cleanup removes the expired one (counted) and the earlier index keys
    assert manager.cleanup_expired() == 1
    assert redis_client.hkeys(keys.claims) == []
    assert not redis_client.exists(*keys.legacy_keys)
    assert isinstance(manager.claim(Q, "old", "w2", LEASE), Success)


def test_cleanup_with_a_limit_resumes_its_sweep_and_removes_exactly_the_limit(
    redis_client: redis.Redis,
) -> None:
    # Given more expired claims than one sweep page holds, and some live ones among them
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    for i in range(2_000):
        manager.claim(Q, f"e{i}", "w", 10)
    for i in range(300):
        manager.claim(Q, f"l{i}", "w", LEASE)
    clock.advance(10)

    # When cleanup runs with a limit, again and again
    removed = [manager.cleanup_expired(limit=700) for _ in range(4)]

    # Then each run removed exactly its limit while enough were left, and only expired ones
    assert removed == [700, 700, 600, 0]
    assert manager.stats().expirations == 2_000
    assert manager.active_claims(Q) == redis_client.hlen(manager.keys(Q).claims) == 300


def test_a_run_with_a_limit_examines_a_bounded_share_of_the_records(
    redis_client: redis.Redis,
) -> None:
    # Given many more records past their retention than a small limit lets a run examine
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    records = 3 * CLEANUP_BATCH
    tokens = [manager.claim(Q, f"t{i}", "w", LEASE).token for i in range(records)]
    manager.execute_many([manager.complete_call(t, 10) for t in tokens if t])
    clock.advance(10)
    limit = 5
    assert limit * SWEEP_PER_LIMIT < CLEANUP_BATCH

    # When one run with that limit sweeps
    manager.cleanup_expired(limit=limit)

    # Then it read about one page of records, not all of them, and later runs purge the rest
    left = redis_client.hlen(manager.keys(Q).done)
    assert records - 2 * CLEANUP_BATCH <= left < records
    runs = 1
    while redis_client.hlen(manager.keys(Q).done) and runs < 20:
        manager.cleanup_expired(limit=limit)
        runs += 1
    assert redis_client.hlen(manager.keys(Q).done) == 0
    assert runs > 1
