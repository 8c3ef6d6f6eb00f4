"""apply_once_redis on Redis and Redis Cluster: the writes and the marker in one script, once."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_claims import InvalidArgument
from celery_claims.effects import MAX_EFFECT_KEY_CHARS, apply_once_redis
from tests.servers import RedisClusterNodes, RedisServer


@pytest.fixture(params=["redis", pytest.param("cluster", marks=pytest.mark.cluster)])
def client(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A client of the private Redis or the private Redis Cluster."""
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        connection: Any = server.client()
    else:
        nodes: RedisClusterNodes = request.getfixturevalue("redis_cluster")
        connection = nodes.client()
    try:
        yield connection
    finally:
        connection.close()


@pytest.fixture
def tag(key_prefix: str) -> str:
    """The test's hash tag: its marker and data keys share one Cluster slot."""
    return f"{{{key_prefix}}}"


def snapshot(client: Any, tag: str) -> dict[bytes, tuple[bytes, int]]:
    """Every key of the test, DUMPed with its TTL: the state byte for byte."""
    keys = (
        client.keys(f"{tag}*", target_nodes="all") if _cluster(client) else client.keys(f"{tag}*")
    )
    return {key: (client.dump(key), client.pttl(key)) for key in sorted(keys)}


def _cluster(client: Any) -> bool:
    return isinstance(client, redis.RedisCluster)


def test_first_copy_applies_every_op_and_a_second_copy_writes_nothing(
    client: Any, tag: str
) -> None:
    # Given the ops of one effect (a payment: a status, a counter, a log entry)
    marker = f"{tag}:effect:orders/abc:0:0"
    ops = [
        ("SET", f"{tag}:status", "paid"),
        ("INCRBY", f"{tag}:paid", 5),
        ("HSET", f"{tag}:invoice", "state", "paid", "by", "w1"),
        ("HINCRBY", f"{tag}:invoice", "count", 1),
        ("RPUSH", f"{tag}:log", "paid"),
        ("SADD", f"{tag}:payers", "w1"),
        ("ZADD", f"{tag}:rank", 1.5, "w1"),
    ]

    # When the first copy applies it, and a second copy of the attempt comes
    first = apply_once_redis(client, marker, ops, instance=7)
    after_first = snapshot(client, tag)
    second = apply_once_redis(client, marker, ops, instance=8)

    # Then the first ran every op and set the marker to its instance; the second changed nothing
    assert (first, second) == (True, False)
    assert snapshot(client, tag) == after_first
    assert client.get(f"{tag}:status") == b"paid"
    assert client.get(f"{tag}:paid") == b"5"
    assert client.hgetall(f"{tag}:invoice") == {b"state": b"paid", b"by": b"w1", b"count": b"1"}
    assert client.lrange(f"{tag}:log", 0, -1) == [b"paid"]
    assert client.zscore(f"{tag}:rank", "w1") == 1.5
    assert client.get(marker) == b"7"
    assert client.pttl(marker) == -1


def test_another_attempt_applies_and_a_marker_ttl_is_set(client: Any, tag: str) -> None:
    # Given attempt 0 applied its increment
    counter = f"{tag}:total"
    assert apply_once_redis(client, f"{tag}:fx:t:0:0", [("INCRBY", counter, 10)])

    # When attempt 1 (another key) applies its own, with a marker TTL
    assert apply_once_redis(client, f"{tag}:fx:t:1:0", [("INCRBY", counter, 10)], ttl_ms=60_000)

    # Then both landed, and only the second marker expires
    assert client.get(counter) == b"20"
    assert client.pttl(f"{tag}:fx:t:0:0") == -1
    assert 0 < client.pttl(f"{tag}:fx:t:1:0") <= 60_000


def test_an_op_the_data_would_refuse_writes_nothing_and_a_retry_after_the_fix_applies(
    client: Any, tag: str
) -> None:
    # Given a key holding a string where the effect's third op writes a hash,
    # and a counter holding text where an increment is asked
    client.set(f"{tag}:invoice", "not a hash")
    client.hset(f"{tag}:stats", "count", "many")
    before = snapshot(client, tag)
    marker = f"{tag}:effect"
    ops = [
        ("SET", f"{tag}:status", "paid"),
        ("RPUSH", f"{tag}:log", "paid"),
        ("HSET", f"{tag}:invoice", "state", "paid"),
    ]

    # When the effect is applied, and an effect incrementing the text
    with pytest.raises(InvalidArgument, match="another type") as wrong_type:
        apply_once_redis(client, marker, ops)
    with pytest.raises(InvalidArgument, match="not an integer") as not_integer:
        apply_once_redis(client, marker, [("HINCRBY", f"{tag}:stats", "count", 1)])
    with pytest.raises(InvalidArgument, match="overflow"):
        apply_once_redis(
            client, marker, [("INCRBY", f"{tag}:n", 2**62), ("INCRBY", f"{tag}:n", 2**62)]
        )

    # Then nothing was written, not even the ops before the refused one, nor the marker
    assert (wrong_type.value.name, not_integer.value.name) == ("ops[2]", "ops[0]")
    assert snapshot(client, tag) == before

    # And once the key is replaced within the effect (DEL first), it applies
    fixed = [("DEL", f"{tag}:invoice"), *ops]
    assert apply_once_redis(client, marker, fixed)
    assert client.hgetall(f"{tag}:invoice") == {b"state": b"paid"}


def test_ops_are_checked_in_order_against_what_earlier_ops_wrote(client: Any, tag: str) -> None:
    # Given a counter created and incremented within one effect, and a hash replaced by a string
    client.hset(f"{tag}:h", "n", "1")
    ops = [
        ("SET", f"{tag}:n", "41"),
        ("INCRBY", f"{tag}:n", 1),
        ("DEL", f"{tag}:h"),
        ("HINCRBY", f"{tag}:h", "n", 5),
    ]

    # When applied, Then the simulation agrees with Redis and every op landed
    assert apply_once_redis(client, f"{tag}:m1", ops)
    assert client.get(f"{tag}:n") == b"42"
    assert client.hgetall(f"{tag}:h") == {b"n": b"5"}

    # And a SET followed by HSET on the same key is refused before anything is written
    before = snapshot(client, tag)
    with pytest.raises(InvalidArgument, match=r"ops\[1\]"):
        apply_once_redis(
            client, f"{tag}:m2", [("SET", f"{tag}:x", "1"), ("HSET", f"{tag}:x", "f", "v")]
        )
    assert snapshot(client, tag) == before


def test_two_racing_copies_apply_exactly_once_every_time(client: Any, tag: str) -> None:
    # Given two copies of each of 50 effects, each on its own connection
    rounds = 50
    results: dict[int, list[bool]] = {n: [] for n in range(rounds)}
    errors: list[BaseException] = []
    counter = f"{tag}:applied"
    connections = [client, _twin(client)]

    def copy(number: int, connection: Any, barrier: threading.Barrier) -> None:
        try:
            barrier.wait(timeout=10)
            ops = [("INCRBY", counter, 1), ("RPUSH", f"{tag}:log", f"e{number}")]
            results[number].append(apply_once_redis(connection, f"{tag}:fx:e{number}", ops))
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    try:
        # When the two copies of every effect race
        for number in range(rounds):
            barrier = threading.Barrier(2)
            threads = [
                threading.Thread(target=copy, args=(number, connection, barrier))
                for connection in connections
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
    finally:
        connections[1].close()

    # Then each effect was applied by exactly one copy and written exactly once
    assert errors == []
    assert all(sorted(done) == [False, True] for done in results.values()), results
    assert client.get(counter) == str(rounds).encode()
    assert client.lrange(f"{tag}:log", 0, -1) == [f"e{n}".encode() for n in range(rounds)]


def _twin(client: Any) -> Any:
    """A second client of the same server or cluster (its own connections)."""
    if _cluster(client):
        node = client.get_default_node()
        return redis.RedisCluster(host=node.host, port=node.port)  # type: ignore[abstract]
    kwargs = client.get_connection_kwargs()
    return redis.Redis(host=kwargs["host"], port=kwargs["port"])


def test_the_script_is_reloaded_after_script_flush(client: Any, tag: str) -> None:
    # Given the script was loaded, and then flushed from the server(s)
    assert apply_once_redis(client, f"{tag}:a", [("SET", f"{tag}:v", "a")])
    client.script_flush()  # on a cluster client: every primary

    # When the next effect runs, Then redis-py reloads it (NOSCRIPT) and it applies
    assert apply_once_redis(client, f"{tag}:b", [("SET", f"{tag}:v", "b")])
    assert client.get(f"{tag}:v") == b"b"


def test_bad_input_is_refused_and_leaves_redis_byte_for_byte_unchanged(
    client: Any, tag: str
) -> None:
    # Given an applied effect
    marker = f"{tag}:m"
    assert apply_once_redis(client, marker, [("SET", f"{tag}:v", "1")], instance=3)
    before = snapshot(client, tag)
    good = ("SET", f"{tag}:v", "2")
    fresh = f"{tag}:fresh"

    bad: list[tuple[str, dict[str, Any]]] = [
        ("marker_key", {"marker_key": ""}),
        ("marker_key", {"marker_key": b"bytes"}),
        ("marker_key", {"marker_key": "k" * (MAX_EFFECT_KEY_CHARS + 1)}),
        ("ops", {"ops": []}),
        ("ops", {"ops": "SET k v"}),
        ("ops[1]", {"ops": [good, ("GETDEL", f"{tag}:v")]}),
        ("ops[1]", {"ops": [good, ("EVAL", "return 1", 0)]}),
        ("ops[0]", {"ops": [("SET", f"{tag}:v")]}),
        ("ops[0]", {"ops": [("SET", f"{tag}:v", "a", "b")]}),
        ("ops[0]", {"ops": [("HSET", f"{tag}:h", "field")]}),
        ("ops[0]", {"ops": [("DEL", f"{tag}:v", f"{tag}:w")]}),
        ("ops[0]", {"ops": [["SET", f"{tag}:v", "2"]]}),
        ("ops[0] key", {"ops": [("SET", "", "2")]}),
        ("ops[0][2]", {"ops": [("INCRBY", f"{tag}:v", 1.5)]}),
        ("ops[0][2]", {"ops": [("INCRBY", f"{tag}:v", 2**63)]}),
        ("ops[0][2]", {"ops": [("ZADD", f"{tag}:z", math.nan, "m")]}),
        ("ops[0][2]", {"ops": [("SET", f"{tag}:v", True)]}),
        ("ops[0][2]", {"ops": [("SET", f"{tag}:v", None)]}),
        ("ops", {"ops": [("SET", fresh, "2")]}),  # writes the marker key itself
        ("ttl_ms", {"ttl_ms": 0}),
        ("ttl_ms", {"ttl_ms": -1}),
        ("ttl_ms", {"ttl_ms": True}),
        ("ttl_ms", {"ttl_ms": "1000"}),
        ("instance", {"instance": -1}),
        ("instance", {"instance": 2**63}),
        ("instance", {"instance": 1.0}),
        ("client", {"client": object()}),
    ]

    # When each bad call is made (on a fresh marker, so only validation can stop it)
    refused = []
    for _, overrides in bad:
        call: dict[str, Any] = {"client": client, "marker_key": fresh, "ops": [good]}
        call.update(overrides)
        with pytest.raises(InvalidArgument) as raised:
            apply_once_redis(call.pop("client"), call.pop("marker_key"), call.pop("ops"), **call)
        refused.append(raised.value.name)

    # Then each names its bad argument, and nothing was written
    assert refused == [name for name, _ in bad]
    assert snapshot(client, tag) == before


@pytest.mark.cluster
def test_keys_in_several_cluster_slots_are_refused_before_redis_is_called(
    redis_cluster: RedisClusterNodes, key_prefix: str
) -> None:
    # Given a cluster client and an effect whose data key has no hash tag
    client = redis_cluster.client()
    marker = f"{{{key_prefix}}}:fx"
    untagged = f"{key_prefix}:elsewhere"

    # When it is applied, Then it is refused and neither key exists
    with pytest.raises(InvalidArgument, match="hash slot"):
        apply_once_redis(client, marker, [("SET", untagged, "1")])
    assert client.exists(marker) == client.exists(untagged) == 0
