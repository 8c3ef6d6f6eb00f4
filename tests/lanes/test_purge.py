"""``purge_stale`` of the Redis store: the records nobody claimed, retried or renewed since a
cutoff go, each removed atomically (re-read inside the script), in bounded batches; every
other record, and the store on bad input, stay as they were."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest

from celery_claims.errors import TaskNotFound
from celery_claims.lanes import InvalidValueError, TaskClaimCandidate, TaskLaneConfig
from celery_claims.lanes.keys import member, task_index_key
from celery_claims.lanes.redis import PURGE_BATCH, RedisTaskClaimStore
from tests.lanes.conftest import T0, Harness, redis_dump
from tests.servers import RedisServer, command_calls

TICKETS = TaskLaneConfig(lane="exports", kinds=("exports",), limit=10)
OTHER = TaskLaneConfig(lane="other", kinds=("other",), limit=1)
#: The cutoff of most tests, and the store clock's now (a little later).
CUTOFF = T0 + timedelta(seconds=100)
NOW = CUTOFF + timedelta(seconds=50)
#: The commands the purge script runs inside Redis.
SCRIPT_INTERNAL = {"hget", "hdel", "zrem", "zrangebyscore"}


def _store(client: Any, prefix: str) -> RedisTaskClaimStore:
    return RedisTaskClaimStore(
        client=client, lanes=[TICKETS, OTHER], prefix=prefix, clock=lambda: NOW
    )


def _claim(
    store: RedisTaskClaimStore, ticket: int, lease: datetime, key: str, token: int = 0
) -> None:
    claimed = store.claim_candidates_for_lane(
        TICKETS,
        [TaskClaimCandidate(0, ticket, token, token + 1)],
        T0,
        lease - timedelta(seconds=30),
        lease,
        keys=[key],
        limit_per_key=1,
    )
    assert [c.task_id for c in claimed] == [ticket]


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _tickets(store: RedisTaskClaimStore, *ids: int, due: datetime = T0) -> None:
    for ticket in ids:
        store.enqueue(ticket, "exports", next_run_at=due)


@pytest.mark.parametrize(
    "kind", ["redis", "redis-decoded", pytest.param("redis-cluster", marks=pytest.mark.cluster)]
)
def test_tickets_idle_since_before_the_cutoff_go_and_every_other_record_stays(
    kind: str, make_harness: Callable[[str, tuple[TaskLaneConfig[Any, Any], ...]], Harness]
) -> None:
    harness = make_harness(kind, (TICKETS, OTHER))
    store = _store(harness.store.client, harness.store.prefix)
    # Given a dead worker's keyed ticket (lease expired before the cutoff) and its free ticket
    # (given back before it)
    _tickets(store, 1, 2, 3, 4, 5, 6)
    _claim(store, 1, T0 + timedelta(seconds=30), "t-kill")
    _claim(store, 2, T0 + timedelta(seconds=30), "t-free")
    store.retry(2, 1, next_run_at=T0 + timedelta(seconds=40))
    # ... a live worker's running ticket (renewed past the cutoff), a ticket whose lease
    # expired exactly at the cutoff (recently: not before it), a ticket given back after the
    # cutoff, and a done one
    _claim(store, 3, T0 + timedelta(seconds=30), "t-live")
    store.heartbeat(3, 1, lease_expires_at=NOW + timedelta(seconds=30))
    _claim(store, 4, CUTOFF, "t-recent")
    _claim(store, 5, T0 + timedelta(seconds=30), "t-back")
    store.retry(5, 1, next_run_at=CUTOFF + timedelta(seconds=1))
    _claim(store, 6, T0 + timedelta(seconds=30), "t-done")
    store.complete(6, 1)
    # ... and another lane's stale ticket
    store.enqueue(7, "other", next_run_at=T0)
    kept = {t: store.get_task(t) for t in (3, 4, 5, 6, 7)}

    # When the lane's records idle since before the cutoff are purged
    purged = store.purge_stale(TICKETS, stale_before=CUTOFF, limit=100)

    # Then the dead worker's two tickets are gone: record, sorted set entry and id index
    assert sorted(purged) == [1, 2]
    client = harness.store.client
    for ticket in (1, 2):
        assert store.get_task(ticket) is None
        assert client.hget(task_index_key(store.prefix), str(ticket)) is None
    keys = store.lane_keys("exports")
    assert client.zscore(keys.processing("exports"), member(1)) is None
    assert client.zscore(keys.due("exports"), member(2)) is None
    # ... with the dead key's name
    values = [_bytes(v) for v in client.hvals(keys.tasks)]
    assert values
    assert not any(b"t-kill" in value for value in values)
    dump = redis_dump(client, store.prefix)
    # ... and every other record is as it was
    assert {t: store.get_task(t) for t in kept} == kept
    # ... and purging again removes nothing
    assert store.purge_stale(TICKETS, stale_before=CUTOFF, limit=100) == []
    assert redis_dump(client, store.prefix) == dump


def test_the_purge_reads_a_large_lane_in_batches_and_stops_at_its_limit(
    redis_server: RedisServer, key_prefix: str
) -> None:
    # Given 2.5 batches of stale tickets and one live one
    client = redis_server.client()
    store = _store(client, key_prefix)
    stale = int(PURGE_BATCH * 2.5)
    _tickets(store, *range(1, stale + 1))
    _tickets(store, stale + 1, due=NOW)
    assert store.purge_stale(TICKETS, stale_before=T0, limit=1) == []  # the script is loaded
    observer = redis_server.client()
    before = command_calls(observer)

    # When at most 2 batches and 10 are purged, and then the rest
    limit = 2 * PURGE_BATCH + 10
    first = store.purge_stale(TICKETS, stale_before=CUTOFF, limit=limit)

    # Then exactly that many went, in 3 scripts, each followed by one HDEL of their id index
    # entries (the other HDELs are the scripts'), and nothing read the whole lane
    after = command_calls(observer)
    delta = {name: after[name] - before.get(name, 0) for name in after}
    delta["info"] -= 1
    assert {n: d for n, d in delta.items() if d and n not in SCRIPT_INTERNAL} == {"evalsha": 3}
    assert delta["hdel"] == limit + 3
    assert delta["zrangebyscore"] == 3
    assert len(first) == limit
    rest = store.purge_stale(TICKETS, stale_before=CUTOFF, limit=10 * PURGE_BATCH)
    assert sorted(first + rest) == list(range(1, stale + 1))
    assert store.get_task(stale + 1) is not None
    observer.close()
    client.close()


def test_a_purged_tickets_holder_is_told_the_ticket_is_gone(
    redis_server: RedisServer, key_prefix: str
) -> None:
    # Given a worker stalled past the grace: its running ticket 1 and its free ticket 2 purged
    client = redis_server.client()
    store = _store(client, key_prefix)
    _tickets(store, 1, 2)
    _claim(store, 1, T0 + timedelta(seconds=30), "t-stalled")
    assert sorted(store.purge_stale(TICKETS, stale_before=CUTOFF, limit=10)) == [1, 2]

    # When it renews, gives back or claims them, Then each says which ticket is gone (a
    # TaskNotFound, which is an InvalidValueError), and a claim changes nothing
    with pytest.raises(TaskNotFound) as renewing:
        store.heartbeat(1, 1, lease_expires_at=NOW + timedelta(seconds=30))
    with pytest.raises(TaskNotFound):
        store.retry(1, 1, next_run_at=NOW)
    [lost] = store.heartbeat_many([(1, 1)], lease_expires_at=NOW + timedelta(seconds=30))
    dump = redis_dump(client, key_prefix)
    with pytest.raises(TaskNotFound) as claiming:
        store.claim_candidates_for_lane(
            TICKETS, [TaskClaimCandidate(0, 2, 0, 1)], NOW, NOW, NOW + timedelta(seconds=30)
        )
    assert renewing.value.task_id == 1
    assert renewing.value.lane is None
    assert isinstance(lost, TaskNotFound)
    assert lost.task_id == 1
    assert claiming.value.task_id == 2
    assert claiming.value.lane == "exports"
    assert isinstance(claiming.value, InvalidValueError)
    assert redis_dump(client, key_prefix) == dump
    client.close()


@pytest.mark.parametrize(
    ("lane", "stale_before", "limit", "message"),
    [
        (TaskLaneConfig("nope", ("nope",), 1), CUTOFF, 10, "is not a lane of this store"),
        (TaskLaneConfig("exports", ("other",), 1), CUTOFF, 10, "is not a lane of this store"),
        ("exports", CUTOFF, 10, "lane_config must be a TaskLaneConfig"),
        (TICKETS, CUTOFF.replace(tzinfo=None), 10, "stale_before must be timezone-aware"),
        (TICKETS, "2030-01-01", 10, "stale_before must be a datetime"),
        (TICKETS, NOW + timedelta(microseconds=1), 10, "stale_before must not be after now"),
        (TICKETS, CUTOFF, -1, "limit must be between 0"),
        (TICKETS, CUTOFF, True, "limit must be an int"),
        (TICKETS, CUTOFF, 2.0, "limit must be an int"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_purged(
    redis_server: RedisServer,
    key_prefix: str,
    lane: Any,
    stale_before: Any,
    limit: Any,
    message: str,
) -> None:
    # Given a stale ticket
    client = redis_server.client()
    store = _store(client, key_prefix)
    _tickets(store, 1)
    before = redis_dump(client, key_prefix)
    index = client.hgetall(task_index_key(key_prefix))

    # When a purge is asked with a bad argument, Then it is refused and nothing changed
    with pytest.raises(InvalidValueError, match=message):
        store.purge_stale(lane, stale_before=stale_before, limit=limit)
    assert redis_dump(client, key_prefix) == before
    assert client.hgetall(task_index_key(key_prefix)) == index
    client.close()


def test_a_limit_of_zero_purges_nothing(redis_server: RedisServer, key_prefix: str) -> None:
    client = redis_server.client()
    store = _store(client, key_prefix)
    _tickets(store, 1)
    assert store.purge_stale(TICKETS, stale_before=CUTOFF, limit=0) == []
    assert store.get_task(1) is not None
    client.close()
