"""What only the Redis store promises: one round trip per batch, one slot per lane, escaping,
script reloading, and driver errors translated at the boundary."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_claims.lanes import CodecError, IoError, LeaseLost, TaskClaimCandidate, TaskLaneConfig
from celery_claims.lanes.keys import member
from celery_claims.lanes.redis import RedisTaskClaimStore
from tests.lanes.conftest import LANES, MAIL, T0
from tests.servers import (
    RedisClusterNodes,
    RedisServer,
    command_calls,
    free_port,
    on_every_server,
)

LEASE = T0 + timedelta(seconds=30)


#: The commands the lane claim script runs inside Redis (counted by commandstats too).
SCRIPT_INTERNAL = {"hget", "hset", "zadd", "zrem", "zcount"}


@on_every_server
def test_claiming_a_batch_is_one_round_trip_of_one_command(store_server: RedisServer) -> None:
    # Given a store whose scripts are loaded, and 100 due tasks
    client = store_server.client()
    observer = store_server.client()
    store = RedisTaskClaimStore(client=client, lanes=LANES, prefix="onetrip")
    store.claim_candidates_for_lane(MAIL, [], T0, T0, LEASE)
    store.enqueue(1000, "send_sms", next_run_at=T0)
    store.claim_candidates_for_lane(MAIL, [TaskClaimCandidate(0, 1000, 0, 1)], T0, T0, LEASE)
    for task_id in range(100):
        store.enqueue(task_id, "send_email", next_run_at=T0)
    candidates = [TaskClaimCandidate(i, i, 0, 1) for i in range(100)]
    lane = TaskLaneConfig("mail", MAIL.kinds, 101)
    before = command_calls(observer)

    # When the batch of 100 candidates is claimed
    claimed = store.claim_candidates_for_lane(lane, candidates, T0, T0, LEASE)

    # Then the client sent one EVALSHA and nothing else (besides the observer's INFO)
    after = command_calls(observer)
    delta = {name: after[name] - before.get(name, 0) for name in after}
    delta["info"] -= 1
    sent = {name: n for name, n in delta.items() if n and name not in SCRIPT_INTERNAL}
    assert sent == {"evalsha": 1}
    assert len(claimed) == 100
    client.close()
    observer.close()


@on_every_server
def test_worker_that_claimed_a_task_settles_it_in_one_round_trip(
    store_server: RedisServer, key_prefix: str
) -> None:
    # Given a task enqueued by a producer and claimed by a worker (two stores, two processes)
    producer = RedisTaskClaimStore(client=store_server.client(), lanes=LANES, prefix=key_prefix)
    producer.enqueue(1, "send_email", next_run_at=T0)
    producer.enqueue(2, "send_email", next_run_at=T0)
    client = store_server.client()
    worker = RedisTaskClaimStore(client=client, lanes=LANES, prefix=key_prefix)
    candidates = [TaskClaimCandidate(0, 1, 0, 1), TaskClaimCandidate(1, 2, 0, 1)]
    worker.claim_candidates_for_lane(MAIL, candidates, T0, T0, LEASE)
    # settling task 2 loads both scripts, so the count below sees no SCRIPT LOAD
    worker.heartbeat(2, 1, lease_expires_at=LEASE)
    worker.complete(2, 1)
    observer = store_server.client()
    before = command_calls(observer)

    # When the worker renews and completes it
    worker.heartbeat(1, 1, lease_expires_at=LEASE + timedelta(seconds=1))
    worker.complete(1, 1)

    # Then each was one EVALSHA: the claim told the worker the task's kind
    after = command_calls(observer)
    sent = {
        name: after[name] - before.get(name, 0)
        for name in after
        if name not in SCRIPT_INTERNAL | {"info"} and after[name] != before.get(name, 0)
    }
    assert sent == {"evalsha": 2}
    for c in (client, observer, producer.client):
        c.close()


@on_every_server
def test_script_cache_flush_is_survived(plain_redis: redis.Redis, key_prefix: str) -> None:
    # Given a store whose scripts are loaded, then a SCRIPT FLUSH
    store = RedisTaskClaimStore(client=plain_redis, lanes=LANES, prefix=key_prefix)
    store.enqueue(1, "send_email", next_run_at=T0)
    plain_redis.script_flush()

    # When it claims
    claimed = store.claim_candidates_for_lane(MAIL, [TaskClaimCandidate(0, 1, 0, 1)], T0, T0, LEASE)

    # Then redis-py reloads the script on NOSCRIPT and the claim goes through
    assert [c.task_id for c in claimed] == [1]


@pytest.mark.cluster
def test_every_key_of_a_lane_is_in_one_cluster_slot(redis_cluster: RedisClusterNodes) -> None:
    # Given lanes and kinds whose names hold braces and colons
    odd = TaskLaneConfig(lane="a{b}:c", kinds=("k{1}", "k:2"), limit=2)
    plain = TaskLaneConfig(lane="other", kinds=("x",), limit=2)
    client = redis_cluster.client()
    store = RedisTaskClaimStore(client=client, lanes=[odd, plain], prefix="slots")
    store.enqueue(1, "k{1}", next_run_at=T0)
    store.enqueue(2, "k:2", next_run_at=T0)
    store.enqueue(3, "x", next_run_at=T0)

    # When the odd lane claims both its tasks on the cluster
    claimed = store.claim_candidates_for_lane(
        odd, [TaskClaimCandidate(0, 1, 0, 1), TaskClaimCandidate(1, 2, 0, 1)], T0, T0, LEASE
    )

    # Then it worked, all of the lane's keys hash to one slot, and the escaped tag is theirs
    assert [c.task_id for c in claimed] == [1, 2]
    keys = store.lane_keys(odd.lane_key)
    names = [
        keys.tasks,
        *(keys.due(k) for k in odd.kinds),
        *(keys.processing(k) for k in odd.kinds),
    ]
    slots = {client.keyslot(name) for name in names}
    assert len(slots) == 1
    assert all("{a%7Bb%7D%3Ac}" in name for name in names)
    client.close()


@on_every_server
def test_decode_responses_does_not_change_what_is_stored(store_server: RedisServer) -> None:
    # Given the same operations through a bytes client and a decoding client
    dumps = []
    for decode in (False, True):
        client = store_server.client(decode_responses=decode)
        prefix = f"decode{int(decode)}"
        store = RedisTaskClaimStore(client=client, lanes=LANES, prefix=prefix)
        store.enqueue(1, "send_email", next_run_at=T0, payload="ünïcode")
        store.claim_candidates_for_lane(MAIL, [TaskClaimCandidate(0, 1, 0, 1)], T0, T0, LEASE)
        raw = store_server.client()
        dumps.append(raw.hget(store.lane_keys("mail").tasks, member(1)))
        raw.close()
        client.close()

    # Then the stored records are identical
    assert dumps[0] == dumps[1]


def test_unreachable_redis_raises_io_error_with_the_driver_error_as_cause() -> None:
    # No retries: redis-py's default backoff would only make the test slower.
    client = redis.Redis(port=free_port(), socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    store = RedisTaskClaimStore(client=client, lanes=LANES)
    with pytest.raises(IoError) as error:
        store.list_claimable_by_kinds(T0, T0, MAIL.kinds, 1)
    assert isinstance(error.value.__cause__, redis.ConnectionError)
    with pytest.raises(IoError):
        store.complete(1, 1)
    with pytest.raises(IoError):
        store.claim_candidates_for_lane(MAIL, [TaskClaimCandidate(0, 1, 0, 1)], T0, T0, LEASE)


@on_every_server
def test_corrupt_record_raises_codec_error(plain_redis: redis.Redis, key_prefix: str) -> None:
    store = RedisTaskClaimStore(client=plain_redis, lanes=LANES, prefix=key_prefix)
    store.enqueue(1, "send_email", next_run_at=T0)
    plain_redis.hset(store.lane_keys("mail").tasks, member(1), b"not json")
    with pytest.raises(CodecError):
        store.get_task(1)


@on_every_server
def test_store_built_from_url_owns_and_closes_its_client(
    store_server: RedisServer, key_prefix: str
) -> None:
    store = RedisTaskClaimStore(url=store_server.url, lanes=LANES, prefix=key_prefix)
    store.enqueue(1, "send_email", next_run_at=T0)
    assert store.get_task(1) is not None
    store.close()


@on_every_server
def test_interrupted_enqueue_can_be_repeated(plain_redis: redis.Redis, key_prefix: str) -> None:
    # Given an enqueue that wrote the id index but died before the lane script
    store = RedisTaskClaimStore(client=plain_redis, lanes=LANES, prefix=key_prefix)
    plain_redis.hset(f"{key_prefix}:lane-tasks", "1", '["mail", "send_email"]')
    assert store.get_task(1) is None

    # When the producer repeats it
    store.enqueue(1, "send_email", next_run_at=T0)

    # Then the task exists and is claimable
    listed: Any = store.list_claimable_by_kinds(T0, T0, MAIL.kinds, 1)
    assert [task.id for task in listed] == [1]


@on_every_server
def test_heartbeat_many_renews_every_live_lease_in_one_pipeline_and_reports_each_lost_one(
    store_server: RedisServer, key_prefix: str
) -> None:
    # Given three claimed tasks, one of them claimed again since (its first attempt is stale)
    client = store_server.client()
    store = RedisTaskClaimStore(client=client, lanes=LANES, prefix=key_prefix)
    for task_id in (1, 2, 3):
        store.enqueue(task_id, "send_email", next_run_at=T0)
    wide = TaskLaneConfig("mail", MAIL.kinds, 10)
    store.claim_candidates_for_lane(
        wide, [TaskClaimCandidate(i, i, 0, 1) for i in (1, 2, 3)], T0, T0, LEASE
    )
    store.retry(3, 1, next_run_at=T0)
    store.claim_candidates_for_lane(wide, [TaskClaimCandidate(0, 3, 1, 2)], T0, T0, LEASE)
    store.heartbeat(1, 1, lease_expires_at=LEASE)  # loads the script outside the count
    observer = store_server.client()
    before = command_calls(observer)

    # When the first attempts of all three are renewed in one call
    later = LEASE + timedelta(seconds=60)
    results = store.heartbeat_many([(1, 1), (2, 1), (3, 1)], lease_expires_at=later)

    # Then the live two are renewed, the stale one is reported, in one pipelined round trip
    assert results[:2] == [None, None]
    assert isinstance(results[2], LeaseLost)
    assert store.get_task(1).lease_expires_at == later  # type: ignore[union-attr]
    assert store.get_task(3).lease_expires_at == LEASE  # type: ignore[union-attr]
    after = command_calls(observer)
    sent = {
        name: after[name] - before.get(name, 0)
        for name in after
        if name not in SCRIPT_INTERNAL | {"info", "hget"} and after[name] != before.get(name, 0)
    }
    # redis-py checks the script is loaded once per pipeline (SCRIPT EXISTS) before sending it
    assert sent == {"evalsha": 3, "script": 1}
    client.close()
    observer.close()
