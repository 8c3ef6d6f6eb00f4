"""Behaviour only the Redis backend has: scripts, key layout, clients, outages, durability."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from celery_claims import (
    BackendUnavailable,
    ClaimToken,
    InsufficientReplicas,
    InvalidArgument,
    RedisClaimManager,
    Success,
)
from celery_claims.claims.keys import QueueKeys, escape
from celery_claims.claims.redis import CLEANUP_BATCH
from celery_claims.testing import ManualClock
from tests.servers import RedisServer

Q = "emails"


@pytest.fixture
def manager(redis_client: redis.Redis) -> RedisClaimManager:
    return RedisClaimManager(client=redis_client)


class CountingConnection(redis.Connection):
    """A real connection that counts the requests it sends (one per round trip)."""

    sent = 0

    def send_packed_command(self, command: object, check_health: bool = True) -> None:
        CountingConnection.sent += 1
        super().send_packed_command(command, check_health)  # type: ignore[arg-type]


def test_every_operation_is_one_round_trip_to_the_server(redis_server: RedisServer) -> None:
    pool = redis.ConnectionPool(
        host="127.0.0.1", port=redis_server.port, connection_class=CountingConnection
    )
    manager = RedisClaimManager(client=redis.Redis(connection_pool=pool), prefix="rtt")

    def every_operation(task_id: str) -> None:
        token = manager.claim(Q, task_id, "w", 1_000).token
        assert token is not None
        token = manager.extend(Q, token, 1_000)
        manager.renew(Q, [token], 5_000)
        manager.is_claimed(Q, task_id)
        manager.list_claims(Q)
        manager.active_claims(Q)
        manager.complete(token, 1_000)
        manager.done_record(Q, task_id)

    # the first pass registers the queue (one SADD per process) and loads each script once
    # (NOSCRIPT, SCRIPT LOAD, EVALSHA); from then on every call is a single EVALSHA
    every_operation("warm-up")
    CountingConnection.sent = 0

    every_operation("t1")

    assert CountingConnection.sent == 8
    pool.disconnect()


def test_scripts_survive_script_flush(
    manager: RedisClaimManager, redis_client: redis.Redis
) -> None:
    first = manager.claim(Q, "t1", "w", 60_000)
    redis_client.script_flush()

    second = manager.claim(Q, "t2", "w", 60_000)

    assert isinstance(first, Success)
    assert isinstance(second, Success)
    assert second.token.instance == first.token.instance + 1


@pytest.mark.parametrize("decode", [True, False])
def test_works_with_decoding_and_raw_clients(redis_server: RedisServer, decode: bool) -> None:
    client = redis_server.client(decode_responses=decode)
    client.flushall()
    manager = RedisClaimManager(client=client)

    token = manager.claim("q:ü", "t:ü", "wørker:1", 60_000).token
    assert token is not None
    assert manager.list_claims("q:ü") == [token]
    assert manager.get_token("q:ü", "t:ü", "wørker:1") == token
    assert manager.is_claimed("q:ü", "t:ü") == ("wørker:1", token.expires_at)
    assert manager.known_queues() == ["q:ü"]
    manager.complete(token, 60_000)
    assert manager.done_record("q:ü", "t:ü") is not None
    assert manager.stats().acks == 1
    client.close()


def test_a_url_builds_its_own_client_and_close_disconnects_it(
    private_server: RedisServer,
) -> None:
    with RedisClaimManager(url=private_server.url, prefix="from-url") as manager:
        assert isinstance(manager.claim(Q, "t1", "w", 1_000), Success)

    with private_server.client() as observer:
        # only the observer's own connection is left
        assert len(observer.client_list()) == 1


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({}, "url"),
        ({"url": "redis://x", "client": "both"}, "url"),
        ({"url": ""}, "url"),
        ({"url": "redis://127.0.0.1:1", "prefix": ""}, "prefix"),
        ({"url": "redis://127.0.0.1:1", "prefix": "a{b}"}, "prefix"),
        ({"url": "redis://127.0.0.1:1", "clock": 5}, "clock"),
    ],
)
def test_the_constructor_validates_its_arguments(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        RedisClaimManager(**kwargs)  # type: ignore[arg-type]
    assert raised.value.name == name


def test_all_keys_of_a_queue_share_one_cluster_slot(manager: RedisClaimManager) -> None:
    for queue_id in ["plain", "a:b", "{tagged}", "}{", "%7B"]:
        keys = manager.keys(queue_id)
        names = [
            *keys.claim_keys,
            *keys.release_keys,
            *keys.cleanup_keys,
            *keys.entry_keys,
            *keys.record_keys,
            *keys.read_keys,
        ]
        assert len({key_slot(k.encode()) for k in names}) == 1, names


@given(st.text(min_size=1), st.text(min_size=1))
def test_escaping_is_injective_and_never_leaks_a_hash_tag(a: str, b: str) -> None:
    assert "{" not in escape(a)
    assert "}" not in escape(a)
    assert ":" not in escape(a)
    if a != b:
        assert escape(a) != escape(b)
        assert QueueKeys("claims", a).claims != QueueKeys("claims", b).claims


@pytest.fixture
def private_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.cleanup()


def test_an_unreachable_server_raises_backend_unavailable_and_recovers(
    private_server: RedisServer,
) -> None:
    with RedisClaimManager(url=private_server.url) as manager:
        token = manager.claim(Q, "t1", "w", 60_000).token
        assert token is not None
        private_server.stop()

        with pytest.raises(BackendUnavailable, match="unavailable") as raised:
            manager.claim(Q, "t2", "w", 60_000)
        assert isinstance(raised.value.__cause__, redis.exceptions.ConnectionError)
        with pytest.raises(BackendUnavailable):
            manager.release(token)
        with pytest.raises(BackendUnavailable):
            manager.stats()

        private_server.start()  # no persistence: the restarted server is empty
        assert isinstance(manager.claim(Q, "t2", "w", 60_000), Success)


def test_claims_survive_a_crash_with_appendfsync_always() -> None:
    server = RedisServer(["--appendonly", "yes", "--appendfsync", "always"]).start()
    try:
        manager = RedisClaimManager(client=server.client())
        held = manager.claim(Q, "t1", "worker-1", 600_000).token
        assert held is not None

        server.restart(signal.SIGKILL)

        manager = RedisClaimManager(client=server.client())
        assert manager.get_token(Q, "t1", "worker-1") == held
        assert manager.claim(Q, "t1", "worker-2", 1_000).acquired is False
        # the fencing counter survived too: no instance is ever issued twice
        again = manager.claim(Q, "t2", "worker-2", 1_000)
        assert again.token is not None
        assert again.token.instance == held.instance + 1
    finally:
        server.cleanup()


def test_without_persistence_a_crash_loses_every_claim() -> None:
    server = RedisServer().start()  # --save "" --appendonly no, like the machine's Redis
    try:
        manager = RedisClaimManager(client=server.client())
        assert manager.claim(Q, "t1", "worker-1", 600_000).acquired

        server.restart(signal.SIGKILL)

        manager = RedisClaimManager(client=server.client())
        assert manager.is_claimed(Q, "t1") is None
        assert isinstance(manager.claim(Q, "t1", "worker-2", 1_000), Success)
    finally:
        server.cleanup()


def test_tokens_are_independent_of_the_client_that_issued_them(
    manager: RedisClaimManager, redis_server: RedisServer
) -> None:
    token = manager.claim(Q, "t1", "w", 60_000).token
    assert token is not None
    rebuilt = ClaimToken(**{f: getattr(token, f) for f in token.__dataclass_fields__})

    with redis_server.client(decode_responses=True) as other_client:
        RedisClaimManager(client=other_client).release(rebuilt)

    assert manager.is_claimed(Q, "t1") is None
    assert isinstance(manager.claim(Q, "t1", "w2", 60_000), Success)


def test_wait_replicas_returns_once_a_replica_holds_the_claim() -> None:
    # no diskless-sync delay: the default waits 5 s for more replicas before the first sync
    primary = RedisServer(["--repl-diskless-sync-delay", "0"]).start()
    replica = RedisServer().start()
    try:
        replica.client().replicaof("127.0.0.1", primary.port)
        manager = RedisClaimManager(client=primary.client(), wait_replicas=1, wait_timeout_ms=5_000)
        deadline = time.monotonic() + 10
        # a replica still in its initial sync is listed but cannot acknowledge a WAIT
        while primary.client().info("replication").get("slave0", {}).get("state") != "online":
            assert time.monotonic() < deadline, "the replica never connected"
            time.sleep(0.05)

        token = manager.claim(Q, "t1", "w", 60_000).token
        assert token is not None

        # acknowledged by the replica: a failover to it right now would keep the claim
        on_replica = RedisClaimManager(client=replica.client())
        assert on_replica.is_claimed(Q, "t1") == ("w", token.expires_at)

        greedy = RedisClaimManager(client=primary.client(), wait_replicas=2, wait_timeout_ms=50)
        with pytest.raises(InsufficientReplicas) as raised:
            greedy.claim(Q, "t2", "w", 60_000)
        assert (raised.value.acknowledged, raised.value.required) == (1, 2)
        assert isinstance(raised.value.result, Success)  # written on the primary all the same
        assert manager.is_claimed(Q, "t2") is not None
    finally:
        replica.cleanup()
        primary.cleanup()


@pytest.mark.parametrize("bad", [-1, 65, True, 1.0])
def test_wait_replicas_is_validated(bad: object) -> None:
    with pytest.raises(InvalidArgument, match="wait_replicas"):
        RedisClaimManager(url="redis://127.0.0.1:1", wait_replicas=bad)  # type: ignore[arg-type]


def test_one_cleanup_purges_more_expired_completion_records_than_one_batch(
    redis_client: redis.Redis,
) -> None:
    clock = ManualClock()
    manager = RedisClaimManager(client=redis_client, clock=clock)
    records = CLEANUP_BATCH + 20
    for i in range(records):
        token = manager.claim(Q, f"t{i}", "w", 60_000).token
        assert token is not None
        manager.complete(token, 10)
    assert redis_client.hlen(manager.keys(Q).done) == records
    clock.advance(10)

    assert manager.cleanup_expired() == 0  # no claim expired: records are not counted

    assert redis_client.hlen(manager.keys(Q).done) == 0
